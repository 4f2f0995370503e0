"""Child-side entry point: run a rank's code and leave promptly with its own exit code.

Why this exists: once `jax.distributed` is initialised, JAX's atexit handler waits in a
shutdown barrier for every peer, so a rank that raises or calls `sys.exit(3)` would hang (up to
the shutdown timeout) and then die by SIGABRT, losing its exit code. Here a failing rank prints
its traceback, flushes, and leaves with `os._exit(code)` at once; a rank that succeeds exits
normally, so JAX's shutdown barrier still lines up the ranks that finish together.

The launcher runs each Python child as ``python -u /path/to/jdp/_run.py script.py args...`` (or
``... _run.py -m module args...``, or ``... _run.py --exec program args...`` for --no_python);
`jdp.spawn` runs ``... _run.py --spawn payload.pkl``. It is run by path, not with
``-m jdp._run``, so that jax is not imported before the user's script (which may set
JAX_PLATFORMS or XLA_FLAGS itself). When `JDP_ERROR_FILE` is set, a failing rank also writes
its traceback there, for the parent to report. When `JDP_SUPERVISOR_PID` is set, the process
first arranges (Linux) to be killed if that supervisor dies, even by SIGKILL.
"""
import sys

if __name__ == "__main__":
    # Run as a file, sys.path[0] is jdp/ itself, whose modules (data, state, ...) would shadow
    # top-level packages of the same name: drop it before importing anything else.
    del sys.path[0]

import os  # noqa: E402
import pickle  # noqa: E402
import re  # noqa: E402
import runpy  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import NoReturn

ERROR_FILE_ENV = "JDP_ERROR_FILE"
SUPERVISOR_ENV = "JDP_SUPERVISOR_PID"
BOOTSTRAP_ENV = "JDP_SPAWN_BOOTSTRAP"
LOST_PEER_DELAY_S = 1.0
_LOST_PEER = re.compile(r"gloo|nccl|connection (closed|reset) by peer|coordination service",
                        re.IGNORECASE)


def exit_now(code: int) -> NoReturn:
    """Flush stdout, stderr and logging, then end the process with `code`, skipping atexit.

    Skipping atexit is the point: JAX's handler would wait for the other ranks.
    """
    import logging
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not change the exit code
            pass
    os._exit(code)


def report_failure(code: int = 1, exc: BaseException | None = None) -> NoReturn:
    """Print an exception's traceback to stderr (and to $JDP_ERROR_FILE), then exit_now(code).

    `exc` defaults to the exception being handled. A rank whose collective failed because a
    peer vanished waits a moment before leaving, so that a supervisor sees the peer, the real
    cause, exit first and reports it (both exits would otherwise race by milliseconds).
    """
    exc = exc if exc is not None else sys.exc_info()[1]
    text = "".join(traceback.format_exception(type(exc), exc, _user_frames(exc.__traceback__)))
    sys.stderr.write(text)
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError:
            pass
    if _lost_peer(exc):
        sys.stderr.flush()
        time.sleep(LOST_PEER_DELAY_S)
    exit_now(code)


def _user_frames(tb):
    """`tb` without its leading frames in this file and runpy, as `python script.py` shows it."""
    here = os.path.abspath(__file__)
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (name == "<frozen runpy>" or name.endswith(os.sep + "runpy.py")
                or os.path.abspath(name) == here):
            break
        tb = tb.tb_next
    return tb


def _lost_peer(exc: BaseException | None) -> bool:
    """Does `exc` (or its cause/context) look like a collective that lost a peer?"""
    seen = 0
    while exc is not None and seen < 10:
        if _LOST_PEER.search(str(exc)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def exit_code(exc: SystemExit) -> int:
    """The status Python itself would exit with for an uncaught `exc`."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    return 1


def guarded(target: Callable[[], object]) -> None:
    """Call `target`; on failure leave the process at once with the failure's exit code.

    `sys.exit(0)` and normal returns come back to the caller, so the interpreter exits the
    usual way (atexit handlers included).
    """
    try:
        target()
    except SystemExit as e:
        code = exit_code(e)
        if code == 0:
            return
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)  # what Python prints for sys.exit("message")
        exit_now(code)
    except KeyboardInterrupt:
        report_failure(130)
    except BaseException:  # noqa: B036 - every failure must leave promptly
        report_failure(1)


def _run_script(argv: list) -> None:
    """Run `argv[0]` as __main__ with `argv` as sys.argv, as `python script.py` would."""
    path = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    runpy.run_path(path, run_name="__main__")


def _run_module(argv: list) -> None:
    """Run module `argv[0]` as __main__, as `python -m module` would."""
    sys.argv = [argv[0], *argv[1:]]
    sys.path.insert(0, os.getcwd())
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


def _run_spawned(payload: str) -> None:
    """Run one `jdp.spawn` rank: the parent's sys.path and __main__, initialize, fn(rank, *args).

    The payload holds two pickles: multiprocessing's preparation data (sys.path, cwd, how to
    import the parent's __main__), then (fn, args). While they load, JDP_SPAWN_BOOTSTRAP is
    set, so a `jdp.spawn` call at the top level of the parent's script fails clearly.
    """
    import multiprocessing.spawn
    os.environ[BOOTSTRAP_ENV] = "1"
    with open(payload, "rb") as f:
        multiprocessing.spawn.prepare(pickle.load(f))
        fn, args = pickle.load(f)
    del os.environ[BOOTSTRAP_ENV]
    from jdp.distributed import initialize
    initialize()
    fn(int(os.environ["RANK"]), *args)


def die_with_supervisor() -> None:
    """Linux: get SIGKILL when the supervisor ($JDP_SUPERVISOR_PID) dies; no rank outlives it.

    Done here rather than in a Popen preexec_fn: that would force a plain fork of a
    multithreaded parent (JAX warns about it) instead of CPython's faster vfork. The setting
    survives exec, so --no_python programs get it too.
    """
    parent = os.environ.pop(SUPERVISOR_ENV, None)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the supervisor died before prctl took effect
        os._exit(1)


def main(argv: list) -> None:
    """Dispatch on the first argument: `--spawn PAYLOAD`, `--exec PROGRAM ...`, `-m MODULE ...`
    or `SCRIPT ...`."""
    die_with_supervisor()
    if not argv:
        sys.exit("usage: _run.py [--spawn PAYLOAD | --exec PROGRAM | -m MODULE | SCRIPT] [ARGS]")
    if argv[0] == "--exec":
        os.execvp(argv[1], argv[1:])
    elif argv[0] == "--spawn":
        guarded(lambda: _run_spawned(argv[1]))
    elif argv[0] == "-m":
        guarded(lambda: _run_module(argv[1:]))
    else:
        guarded(lambda: _run_script(argv[1:] if argv[0] == "--" else argv))


if __name__ == "__main__":
    main(sys.argv[1:])
