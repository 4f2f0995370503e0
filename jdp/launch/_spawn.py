"""`jdp.spawn`: run `fn(rank, *args)` in N fresh processes that form one job.

The launcher's job from inside Python (a test, a notebook, a script that owns its processes):
each rank is a fresh interpreter (never a fork: JAX is not fork-safe) watched by the same
supervise loop as `jdp.launch`.
"""
from __future__ import annotations

import ast
import contextlib
import multiprocessing.spawn
import os
import pickle
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from jdp.job import env as _env
from jdp.job import net as _net
from jdp.job import run as _run
from jdp.job import values
from jdp.job.outcome import Job, Outcome, State, report
from jdp.launch import _goodput, _profile_opts, _scratch, _supervisor

WHO = "jdp.spawn"


class ProcessException(RuntimeError):
    """A spawned rank failed; `rank` and `exit_code` (negative: killed by that signal) say how."""

    def __init__(self, message: str, rank: int, exit_code: int):
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code


class ProcessRaisedException(ProcessException):
    """A spawned rank raised; the message ends with its traceback (also in `.traceback`)."""

    def __init__(self, message: str, rank: int, exit_code: int, traceback: str):
        super().__init__(message, rank, exit_code)
        self.traceback = traceback


class ProcessExitedException(ProcessException):
    """A spawned rank exited non-zero or died by a signal without raising a Python exception."""


def spawn(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 1, *,
          devices_per_process: int | None = None, timeout: float | None = None,
          progress_timeout: float | None = None,
          stop_grace: float = _supervisor.STOP_GRACE_S, logdir: str | None = None,
          profile_steps: str | None = None) -> None:
    """Run `fn(rank, *args)` in `nprocs` new processes that form one jdp job; wait for all.

    Each process gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR
    (127.0.0.1) and a free MASTER_PORT, runs `jdp.initialize()`, then calls `fn`. Its output
    is copied to ours, each line prefixed with `[rankK]: `. Once ranks recorded progress (jdp's
    steps, Loader, Checkpointer), a `goodput` line at the end says where the time went. `fn`
    must be importable by a new process: a module-level function (from the main script too,
    when the `jdp.spawn` call is under `if __name__ == "__main__":`), with picklable `args`.
    Return values are dropped.

    Args:
        fn: called as `fn(rank, *args)` in every process.
        args: further positional arguments for `fn`.
        nprocs: number of processes (the world size).
        devices_per_process: give each process this many simulated CPU devices (sets XLA_FLAGS
            before jax is imported there); None keeps this process's XLA_FLAGS.
        timeout: seconds after which all processes are stopped and TimeoutError is raised.
        progress_timeout: the launcher's --progress_timeout: once a rank recorded progress,
            this many seconds without progress on any rank stop all and raise TimeoutError
            naming the ranks behind, with their stacks. None reads JDP_PROGRESS_TIMEOUT.
        stop_grace: after SIGTERM to this process, seconds the ranks get to save and leave
            (see `jdp.preempted`) before SIGKILL.
        logdir: where to write summary.json (where the time went, stragglers) and those
            figures as metrics (`jdp.metrics`), as the launcher's --logdir.
        profile_steps: "A:B", the launcher's --profile_steps: every rank writes a
            `jax.profiler` trace of jdp's training steps A..B to `logdir`/profile/rank.K
            (needs `logdir`; None reads JDP_PROFILE_STEPS).

    Raises:
        ProcessRaisedException: a rank raised; the message names it and holds its traceback.
        ProcessExitedException: a rank exited non-zero or was killed, without a traceback.
        TimeoutError: `timeout` passed, or no progress for `progress_timeout`.
        KeyboardInterrupt: SIGINT arrived (it reached every rank).

    Example:
        >>> import jax, jdp
        >>> def main(rank, steps):
        ...     jdp.print0(jax.device_count())
        >>> if __name__ == "__main__":
        ...     jdp.spawn(main, args=(100,), nprocs=2, devices_per_process=2)
    """
    nprocs, devices_per_process = _check(fn, nprocs, devices_per_process)
    _env.check_settings(os.environ)
    limits = _limits(timeout, progress_timeout, stop_grace)
    if problem := _profile_opts.problem(profile_steps, logdir, "profile_steps=", "logdir=DIR"):
        raise ValueError(problem)
    with _scratch.held("spawn") as tmp:
        payload = os.path.join(tmp, "payload.pkl")
        with open(payload, "wb") as f:
            # multiprocessing's recipe, so `fn` may live in the main script; the authkey as
            # plain bytes: multiprocessing refuses to pickle its wrapper outside its start-up.
            preparation = multiprocessing.spawn.get_preparation_data(WHO)
            pickle.dump({**preparation, "authkey": bytes(preparation["authkey"]),
                         _run.SPAWN_ENTRY: f"{__name__}:{run_rank.__name__}"}, f)
            f.write(_pickled(fn, args))
        cmd = [sys.executable, "-u", _supervisor.RUNNER, "--spawn", payload]
        port = _net.free_port()
        profile_env = _profile_opts.rank_env(profile_steps, logdir)
        specs = [_supervisor.RankSpec(r, cmd, {**_rank_env(r, nprocs, port, tmp,
                                                           devices_per_process), **profile_env})
                 for r in range(nprocs)]
        ledger = _goodput.Ledger(WHO, logdir, from_process_start=False)
        _profile_opts.say(WHO, _profile_opts.no_directory(profile_steps, logdir))
        outcome = _supervisor.run(specs, _supervisor.Output(), limits, ledger=ledger)
        ledger.finish()
        _raise_for(outcome, tmp, nprocs, limits)
        _profile_opts.say(WHO, _profile_opts.no_trace(profile_steps, logdir, ledger.steps_run(),
                                                      "profile_steps="))


def _rank_env(rank: int, nprocs: int, port: int, tmp: str, devices_per_process: int | None) -> dict:
    """Rank `rank`'s environment: the launcher's variables, and an error file under `tmp`."""
    env = _supervisor.rank_env(os.environ, rank=rank, local_rank=rank, world_size=nprocs,
                               local_world_size=nprocs, node_rank=0, master_addr="127.0.0.1",
                               master_port=port, devices_per_process=devices_per_process)
    env[_env.ERROR_FILE] = os.path.join(tmp, f"error.{rank}")
    return env


def _limits(timeout: Any, progress_timeout: Any, stop_grace: Any) -> _supervisor.Limits:
    """The supervisor's clocks from spawn's arguments: each a finite number of seconds > 0 and
    at most a week (None: no limit; `progress_timeout` None reads JDP_PROGRESS_TIMEOUT)."""
    def checked(name: str, value: Any) -> float | None:
        return None if value is None else values.seconds(
            WHO, name, value, maximum=_env.MAX_SECONDS, fix="or None: no limit")

    if progress_timeout is None:
        progress_timeout = _env.seconds(os.environ, _env.PROGRESS_TIMEOUT)
    grace = values.seconds(WHO, "stop_grace", stop_grace, maximum=_env.MAX_SECONDS,
                           fix=f"the default is {_supervisor.STOP_GRACE_S:g}")
    return _supervisor.Limits(timeout_s=checked("timeout", timeout), stop_grace_s=grace,
                              progress_timeout_s=checked("progress_timeout", progress_timeout))


def _check(fn: Callable, nprocs: Any, devices_per_process: Any) -> tuple[int, int | None]:
    """Reject what cannot work before any process starts; returns `(nprocs,
    devices_per_process)` as ints (NumPy's integers taken)."""
    if os.environ.get(_env.SPAWN_BOOTSTRAP) == "1":
        raise RuntimeError("jdp.spawn() ran while a spawned process imported the parent's main "
                           "module: put the call under `if __name__ == '__main__':`")
    nprocs = values.integer(WHO, "nprocs", nprocs, minimum=1, fix="the number of processes")
    if devices_per_process is not None:
        devices_per_process = values.integer(
            WHO, "devices_per_process", devices_per_process, minimum=1,
            fix="or None to keep this process's XLA_FLAGS")
    if not callable(fn):
        raise TypeError(f"fn={fn!r} is not callable; pass the function to run in each process")
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(f"fn={fn.__qualname__} is defined in an interactive session, which new "
                         "processes cannot import; define it in a module (a .py file) and "
                         "import it from there")
    if getattr(fn, "__module__", None) == "__main__" and _under_main_guard(fn, main.__file__):
        raise ValueError(f"fn={fn.__qualname__} is defined under `if __name__ == '__main__':`, "
                         "which the new processes do not run, so they cannot find it; define it "
                         "at module level, above the guard")
    return nprocs, devices_per_process


def _under_main_guard(fn: Callable, path: str) -> bool:
    """Whether `fn`'s `def` sits inside an `if __name__ == "__main__":` block of `path`."""
    line = getattr(getattr(fn, "__code__", None), "co_firstlineno", None)
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return False
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
               and "__name__" in ast.unparse(node.test) and node.lineno < (line or 0)
               <= (node.end_lineno or 0) for node in tree.body)


def _pickled(fn: Callable, args: Sequence[Any]) -> bytes:
    """(fn, args) pickled, or a TypeError that says what a spawned process can load."""
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args={args!r} must be a tuple of fn's further arguments, e.g. "
                        f"args=({args!r},)")
    try:
        return pickle.dumps((fn, tuple(args)))
    except Exception as e:
        raise TypeError(f"jdp.spawn needs a module-level fn and picklable args ({e}); define "
                        f"{getattr(fn, '__qualname__', fn)!r} at the top level of a module, "
                        "not as a lambda or nested function") from None


def _raise_for(outcome: Outcome, tmp: str, nprocs: int, limits: _supervisor.Limits) -> None:
    """Turn a supervised run's outcome into a return or the right exception."""
    state, detail = outcome.state, outcome.detail
    text = report(outcome, Job(WHO, nprocs, progress_timeout_s=limits.progress_timeout_s))
    if state is State.SIGNALED and detail.signal == signal.SIGINT:
        raise KeyboardInterrupt(f"{WHO}: SIGINT; stopped all {nprocs} processes")
    if state is State.SIGNALED:
        signal.raise_signal(detail.signal)   # as if we had not caught it: handler or death
        raise ProcessExitedException(text, -1, -detail.signal)
    if state is State.TIMED_OUT:
        raise TimeoutError(text.replace("the time limit", f"timeout={limits.timeout_s:g} s"))
    if state is State.STALLED:
        raise TimeoutError(text.replace("--progress_timeout", "progress_timeout"))
    if state is not State.FAILED:
        return
    head = text.splitlines()[0]
    path = os.path.join(tmp, f"error.{detail.rank}")
    if os.path.exists(path):
        with open(path) as f:
            trace = f.read()
        raise ProcessRaisedException(f"{head} Its traceback:\n\n{trace}", detail.rank,
                                     detail.returncode, trace)
    raise ProcessExitedException(text, detail.rank, detail.returncode)


def run_rank(payload: str) -> None:
    """In a spawned rank (after `run.py` imported the parent's main): initialize, fn(rank, *args).

    The payload holds two pickles: multiprocessing's preparation data (read by `run.py`),
    then (fn, args); it holds the parent's authkey, so the last rank to read it deletes it.
    """
    from jdp.distributed import initialize
    with open(payload, "rb") as f:
        pickle.load(f)
        fn, args = pickle.load(f)
    _mark_read(payload)
    initialize()
    fn(int(os.environ[_env.RANK]), *args)


def _mark_read(payload: str) -> None:
    """Leave a `read.RANK` mark beside the payload; the rank that completes the set deletes it."""
    directory = os.path.dirname(payload)
    open(os.path.join(directory, f"read.{os.environ[_env.RANK]}"), "w").close()
    world = int(os.environ[_env.WORLD_SIZE])
    if all(os.path.exists(os.path.join(directory, f"read.{r}")) for r in range(world)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(payload)
