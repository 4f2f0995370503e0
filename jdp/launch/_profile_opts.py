"""The launcher's side of `--profile_steps A:B`: the option, its check, the ranks' environment
and the trace files named in the goodput summary.

The ranks do the tracing (`jdp.metrics.profile`, through jdp's train step); the launcher only
says which steps and where: LOGDIR/profile, one directory per rank.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

HELP = ("write a jax.profiler trace of training steps A..B (from 1) of every rank\n"
        "to DIR/profile/rank.K (needs --logdir DIR; env JDP_PROFILE_STEPS); see\n"
        "docs/watching.md")


def _names():
    """The rank side's module: it owns the variables' names and the range's parser (imported
    here only when needed: the launcher's modules import the standard library alone)."""
    from jdp.metrics import profile as _profile
    return _profile


def add_argument(p: argparse.ArgumentParser) -> None:
    """--profile_steps A:B (also --profile-steps)."""
    p.add_argument("--profile_steps", "--profile-steps", default=None, metavar="A:B", help=HELP)


def problem(steps: str | None, logdir: str | None, option: str = "--profile_steps ",
            logdir_option: str = "--logdir DIR") -> str | None:
    """A one-line message when `steps` is not a step range or has no log directory to go to,
    or when JDP_PROFILE_STEPS (read when `steps` is None; any directory will do for it) is
    not a range; None when fine or off."""
    names = _names()
    if steps is None:
        steps, option, logdir = os.environ.get(names.STEPS) or None, names.STEPS + "=", "."
    if steps is None:
        return None
    try:
        names.parse_steps(steps, source=option)
    except ValueError as e:
        return str(e)
    if logdir is None:
        return (f"{option}{steps!r} needs {logdir_option}: the traces go to its profile/ "
                f"directory (one directory per rank)")
    return None


def rank_env(steps: str | None, logdir: str | None) -> dict:
    """What makes every rank trace steps A..B into LOGDIR/profile: both variables with the
    option; with JDP_PROFILE_STEPS from the environment, LOGDIR/profile unless JDP_PROFILE_DIR
    is set; {} when off."""
    n = _names()
    if logdir is None or steps is None and (not os.environ.get(n.STEPS) or os.environ.get(n.DIR)):
        return {}
    where = {n.DIR: os.path.abspath(os.path.join(logdir, "profile"))}
    return where if steps is None else {n.STEPS: steps, **where}


def trace_files(logdir: str | None) -> list[str]:
    """The trace files the ranks wrote under LOGDIR/profile (TensorBoard's .xplane.pb and
    Perfetto's .json.gz), sorted."""
    return _files(os.path.join(logdir, "profile")) if logdir else []


def _files(root: str) -> list[str]:
    found = glob.glob(os.path.join(root, "rank.*", "plugins", "profile", "*", "*"))
    return sorted(f for f in found if f.endswith((".xplane.pb", "perfetto_trace.json.gz")))


def trace_dir(steps: str | None, logdir: str | None) -> str | None:
    """Where the ranks write their traces (rank.K below it): LOGDIR/profile, else
    JDP_PROFILE_DIR, else ./profile in their working directory; None when nothing is asked."""
    n = _names()
    if steps is None and not os.environ.get(n.STEPS):
        return None
    return (rank_env(steps, logdir).get(n.DIR) or os.environ.get(n.DIR)
            or os.path.abspath(n.DEFAULT_DIR))


def no_directory(steps: str | None, logdir: str | None) -> str | None:
    """The launcher's note when JDP_PROFILE_STEPS comes from the environment with neither
    JDP_PROFILE_DIR nor a log directory: where the traces will go, and how to choose."""
    n = _names()
    if steps is not None or logdir is not None or not os.environ.get(n.STEPS) or (
            os.environ.get(n.DIR)):
        return None
    return (f"{n.STEPS}={os.environ[n.STEPS]!r} is set without {n.DIR} or a log directory: "
            f"each rank writes its trace to {trace_dir(None, None)}/rank.K (./{n.DEFAULT_DIR} "
            f"in its working directory); set {n.DIR}=DIR or pass --logdir DIR to choose")


def no_trace(steps: str | None, logdir: str | None, steps_run: int,
             option: str = "--profile_steps ") -> str | None:
    """At the end of a run: why the step range asked for produced no trace file (the run
    ended before step A, or its steps were not jdp.train_step's); None when it did."""
    n = _names()
    root = trace_dir(steps, logdir)
    if root is None or _files(root):
        return None
    text, source = (steps, option) if steps is not None else (os.environ[n.STEPS], n.STEPS + "=")
    first, _ = n.parse_steps(text, source)
    if 0 < steps_run < first:
        why = (f"the ranks ran {steps_run} training step(s), so the run ended before step "
               f"{first}; choose steps the run reaches")
    else:
        why = (f"the ranks counted {steps_run} training step(s) but traced none: only "
               "jdp.train_step's steps are traced, not a jitted step of your own (wrap those in "
               "jax.profiler.trace(DIR) yourself)")
    return f"{source}{text} produced no trace in {root}: {why}"


def describe(files: list[str]) -> str:
    """The goodput line's words for the trace files: how many ranks, where, how to open them."""
    root = os.path.dirname(files[0].split(os.sep + "plugins" + os.sep)[0])
    ranks = {f.split(os.sep + "plugins" + os.sep)[0] for f in files}
    return (f"profiles of {len(ranks)} ranks in {root} (tensorboard --logdir {root}, or each "
            f"rank's perfetto_trace.json.gz in ui.perfetto.dev)")


def say(who: str, note: str | None) -> None:
    """Print a note of the launcher's (`no_directory`, `no_trace`) on stderr, if any."""
    if note:
        print(f"{who}: {note}", file=sys.stderr, flush=True)
