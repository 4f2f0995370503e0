"""A `jax.profiler` trace of chosen training steps on every rank, asked for by the environment.

`jdp.launch --profile_steps A:B` and `jdp.spawn(profile_steps="A:B")` set `JDP_PROFILE_STEPS`
and `JDP_PROFILE_DIR` (LOGDIR/profile) for every rank; under srun or mpirun a user sets them
(the directory defaults to ./profile). jdp's train step calls `before_step(n)` and
`after_step(n, done)` around step n (counted from 1, as the progress records count): the trace
starts before step A is dispatched and stops once step B has finished, written to
DIR/rank.K/plugins/profile/<time>/<host>.xplane.pb (TensorBoard's profile plugin) with a
`perfetto_trace.json.gz` beside it (ui.perfetto.dev). Each traced step is a
`StepTraceAnnotation("train", step_num=n)`, which TensorBoard's step views group by. Each
train step function counts its own calls; with several, the first to reach step A starts the
trace. A trace the user started already (`jax.profiler.trace`) is left alone, with a warning.

It lives with the metrics, not the launcher: ranks import it (they must not import the
launcher) and the launcher reads its option parser (standard library at import; JAX is
imported only when a trace starts). Off (no `JDP_PROFILE_STEPS`) a step pays one attribute
test.
"""
from __future__ import annotations

import atexit
import os
import warnings
from typing import Any, NamedTuple

from jdp.job import env as _env
from jdp.job import rank as _rank
from jdp.job import values as _values

STEPS = _env.PROFILE_STEPS   # "A:B": trace training steps A..B (from 1, both included)
DIR = _env.PROFILE_DIR       # where every rank writes its trace (rank.K below it)
DEFAULT_DIR = "profile"


class Window(NamedTuple):
    """Steps `first`..`last` (both included), traced into `directory` (this rank's)."""
    first: int
    last: int
    directory: str


def parse_steps(text: str, source: str = "--profile_steps ") -> tuple[int, int]:
    """(A, B) from "A:B"; ValueError naming `source` (the option or variable, with its
    separator) and the fix when it is not a range of training steps 1 <= A <= B, in
    `jdp.job.values`' words (`--profile_steps 5:3: must be A:B, ...`)."""
    first, colon, last = str(text).strip().partition(":")
    if colon and first.strip().isdigit() and last.strip().isdigit():
        a, b = int(first), int(last)
        if 1 <= a <= b:
            return a, b
    raise _values.wrong_value("", source.rstrip(" ="), text, "A:B, the training steps to trace "
                              "with 1 <= A <= B (counted from 1)", f"e.g. {source}10:12")


def window_from_env(environ=os.environ) -> Window | None:
    """The window this rank was asked to trace, or None (no `JDP_PROFILE_STEPS`)."""
    text = environ.get(STEPS, "")
    if not text:
        return None
    first, last = parse_steps(text, source=STEPS + "=")
    return Window(first, last, environ.get(DIR) or DEFAULT_DIR)


def before_step(n: int) -> Any:
    """Called before training step `n` is dispatched: start the trace at step A. Returns the
    step's annotation (a context manager) while tracing, else None."""
    state = _rank.current().profile
    if not state.read:
        state.window, state.read = window_from_env(), True
    w = state.window
    if w is None or not w.first <= n <= w.last:
        return None
    import jax
    if not state.tracing and n == w.first:
        _start(os.path.join(w.directory, f"rank.{jax.process_index()}"))
    return jax.profiler.StepTraceAnnotation("train", step_num=n) if state.tracing else None


def _start(rank_dir: str) -> None:
    """Start this rank's trace; a trace the user already runs wins (jax allows one at a time)."""
    import jax
    try:
        jax.profiler.start_trace(rank_dir, create_perfetto_trace=True)
    except RuntimeError as e:
        warnings.warn(f"jdp: {STEPS} asked for a trace, but {e} Not tracing.", stacklevel=3)
        return
    _rank.current().profile.tracing = True
    atexit.register(_stop)   # a run that ends before step B still keeps its trace


def after_step(n: int, done: Any) -> None:
    """Called once step `n` is dispatched: after step B, wait for it and write the trace."""
    state = _rank.current().profile
    w = state.window
    if state.tracing and w is not None and n >= w.last:
        done.block_until_ready()
        _stop()


def _stop() -> None:
    state = _rank.current().profile
    if state.tracing:
        import jax
        state.tracing = False
        jax.profiler.stop_trace()
