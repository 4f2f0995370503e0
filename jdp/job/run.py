"""The rank side: run one rank's code, and make a failing rank leave at once with its own code.

The supervisor starts each Python rank as ``python -u /path/to/jdp/job/run.py script.py
args...`` (``... run.py -m module args...``; ``... run.py --exec program args...`` for
--no_python; ``... run.py --spawn payload`` for `jdp.spawn`). It is run by path, not as
``-m jdp.job.run``, so that nothing (JAX above all) is imported before the user's script,
which may set JAX_PLATFORMS or XLA_FLAGS itself. So this file imports the standard library only
and no sibling module: it holds the names of the variables it reads, and the exit functions
that `jdp.initialize()` also installs for jobs started by mpirun or srun.

A failing rank (an exception, or `sys.exit(n)` with n != 0) prints its traceback and leaves
with `os._exit(code)` at once: once `jax.distributed` is initialised, JAX's atexit handler
would otherwise wait in a shutdown barrier for every peer and then die by SIGABRT, losing the
code. A rank that succeeds exits normally, so JAX's shutdown barrier still lines up the ranks
that finish together.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import re
import runpy
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

# Between a supervisor and its ranks (jdp.job.env re-exports them).
SUPERVISOR_PID = "JDP_SUPERVISOR_PID"     # the rank dies with this process (Linux)
ERROR_FILE = "JDP_ERROR_FILE"             # a failing rank writes its traceback here
SPAWN_BOOTSTRAP = "JDP_SPAWN_BOOTSTRAP"   # set while a jdp.spawn rank imports the parent's main
STACK_FILE = "JDP_STACK_FILE"             # where the rank dumps its Python stacks on SIGUSR1
SPAWN_ENTRY = "jdp_entry"   # the payload's "module:function" a jdp.spawn rank runs (its launcher's)

LOST_PEER_DELAY_S = 1.0
# A failure no restart can mend (a replica group whose set-up differs from the others', or that
# has no live peer to heal from): an exception with `jdp_exit_code = FINAL_EXIT` ends its rank
# with this status, and the launcher does not restart the job for it (sysexits' EX_CONFIG).
FINAL_EXIT = 78
# An exception with `jdp_shared = True` was raised by every process at once (an agreement's
# verdict): process 0 lets the others print it and leave before it ends (`Peers.failing`),
# since the coordination service ends with process 0 and would abort a peer still printing.
SHARED = "jdp_shared"
_HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCHER_DIRS = (_HERE, os.path.join(os.path.dirname(_HERE), "launch"))
"""Where the frames a traceback leaves out live: this runner's (jdp/job) and jdp.spawn's."""
_LOST_PEER = re.compile(r"gloo|nccl|connection (closed|reset) by peer|coordination service",
                        re.IGNORECASE)
_stack_file = None   # kept open: faulthandler writes to its descriptor
_leaving: list = []  # the status a watchdog thread is ending this process with (see below)
_on_failure: list = []   # called with the exception before a failing rank leaves (`on_failure`)


def on_failure(hook: Callable[[BaseException], None]) -> None:
    """Have `report_failure` call `hook(exc)` before it leaves, unless `exc` looks like the
    echo of a lost peer (the peers' connections tell this process's failure to the others)."""
    _on_failure.append(hook)


def shared(exc: BaseException) -> BaseException:
    """`exc`, marked as raised by every process at once (`SHARED`)."""
    setattr(exc, SHARED, True)
    return exc


def exit_now(code: int) -> NoReturn:
    """Flush stdout, stderr and logging, then end the process with `code`, skipping atexit."""
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
    if _leaving:   # a watchdog ends the job; the main thread's collective failing is its echo
        exit_now(_leaving[0])
    exc = exc if exc is not None else sys.exc_info()[1]
    if not _lost_peer(exc):
        for hook in _on_failure:
            with contextlib.suppress(Exception):
                hook(exc)
    text = "".join(traceback.format_exception(type(exc), exc, _user_frames(exc.__traceback__)))
    sys.stderr.write(text)
    if os.environ.get(ERROR_FILE):
        with contextlib.suppress(OSError), open(os.environ[ERROR_FILE], "w") as f:
            f.write(text)
    if _lost_peer(exc):
        sys.stderr.flush()
        time.sleep(LOST_PEER_DELAY_S)
    exit_now(code)


def leave_with(code: int) -> None:
    """Note that a watchdog thread is about to end this process with `code`: a failure the
    main thread reports meanwhile (a collective that lost its peers) exits with it, silently."""
    _leaving.append(code)


def _user_frames(tb):
    """`tb` without its leading frames in the launcher (this runner, jdp.spawn's rank) and
    runpy, as `python script.py` shows it."""
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (name == "<frozen runpy>" or name.endswith(os.sep + "runpy.py")
                or os.path.dirname(os.path.abspath(name)) in LAUNCHER_DIRS):
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


class PromptExit(SystemExit):
    """The SystemExit that `prompt_sys_exit` raises: leaves at once if nothing catches it.

    Python frees an uncaught SystemExit while no Python frame is running, just before the
    interpreter's exit (and before atexit handlers, where JAX's waits for every peer); a
    caught one is freed inside the frame that handled it. So an uncaught non-zero exit ends
    the process right there with its own code, and a caught one changes nothing.
    """

    def __del__(self) -> None:
        code = system_exit_code(self)
        if code != 0 and sys._getframe().f_back is None:
            exit_now(code)


def prompt_sys_exit(status: object = None) -> NoReturn:
    """`sys.exit` for a rank of a multi-process job: a non-zero exit does not wait for peers."""
    raise PromptExit(status)


def system_exit_code(exc: SystemExit) -> int:
    """The status Python itself would exit with for an uncaught `exc` (0..255)."""
    if exc.code is None:
        return 0
    return exc.code & 0xFF if isinstance(exc.code, int) else 1


def guarded(target: Callable[[], object]) -> None:
    """Call `target`; on failure leave the process at once with the failure's exit code.

    `sys.exit(0)` and normal returns come back, so the interpreter exits the usual way."""
    try:
        target()
    except SystemExit as e:
        code = system_exit_code(e)
        if code == 0:
            return
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)  # what Python prints for sys.exit("message")
        exit_now(code)
    except BaseException:  # noqa: B036 - every failure must leave promptly
        if getattr(sys.excepthook, "_jdp_previous", None):   # jdp.initialize()'s, which
            sys.excepthook(*sys.exc_info())                  # tells the peers first
        report_failure(failure_code(sys.exc_info()[1]))


def failure_code(exc: BaseException | None) -> int:
    """The exit status of a rank that failed with `exc`: 130 after Ctrl-C, the exception's
    own `jdp_exit_code` (FINAL_EXIT: not to be restarted), else 1."""
    if isinstance(exc, KeyboardInterrupt):
        return 130
    code = getattr(exc, "jdp_exit_code", 1)
    return code if isinstance(code, int) and 0 < code < 128 else 1


def die_with_supervisor() -> None:
    """Linux: get SIGKILL when the supervisor ($JDP_SUPERVISOR_PID) dies; no rank outlives it.

    Done here rather than in a Popen preexec_fn: that would force a plain fork of a
    multithreaded parent (JAX warns about it) instead of CPython's faster vfork. The setting
    survives exec, so --no_python programs get it too.
    """
    parent = os.environ.pop(SUPERVISOR_PID, None)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the supervisor died before prctl took effect
        os._exit(1)


def stacks_on_sigusr1() -> None:
    """Make SIGUSR1 write every Python thread's stack to $JDP_STACK_FILE (faulthandler).

    faulthandler writes from the signal handler in C, so it works while the main thread is
    blocked anywhere, in a sleep, a lock or a collective, without the rank's cooperation.
    """
    # The signal handler (faulthandler's, in C) writes to this file's descriptor for the
    # process's life, so the module keeps the file open: a rebinding of a module name.
    global _stack_file
    try:
        _stack_file = open(os.environ[STACK_FILE], "w")
    except (KeyError, OSError):
        return
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)


def _run_spawned(payload: str) -> None:
    """A `jdp.spawn` rank: the parent's import path and __main__ (multiprocessing's recipe), then
    the entry the payload names (`jdp.launch._spawn.run_rank`). While the parent's main is
    imported, JDP_SPAWN_BOOTSTRAP is set, so a `jdp.spawn` call at its top level fails clearly."""
    import importlib
    import multiprocessing.spawn
    with open(payload, "rb") as f:
        preparation = pickle.load(f)
    os.environ[SPAWN_BOOTSTRAP] = "1"
    multiprocessing.spawn.prepare(preparation)
    del os.environ[SPAWN_BOOTSTRAP]
    # importable now (the parent's import path is ours); named by the launcher, which sits above
    module, _, name = preparation[SPAWN_ENTRY].partition(":")
    getattr(importlib.import_module(module), name)(payload)


def main(argv: list) -> None:
    """Run what `argv` names: `--spawn PAYLOAD`, `--exec PROGRAM`, `-m MODULE` or `SCRIPT`."""
    die_with_supervisor()
    if not argv or argv[0] in ("--exec", "--spawn", "-m") and len(argv) < 2:
        sys.exit("usage: run.py [--spawn PAYLOAD | --exec PROGRAM | -m MODULE | SCRIPT] [ARGS]")
    if argv[0] == "--exec":
        os.execvp(argv[1], argv[1:])
    stacks_on_sigusr1()
    if argv[0] == "--spawn":
        return guarded(lambda: _run_spawned(argv[1]))
    argv = argv[1:] if argv[0] == "--" else argv
    module = argv[0] == "-m"
    sys.argv = argv[1:] if module else list(argv)
    # jdp's one edit of the import path, and why: run by path, its first entry is this file's
    # folder; the user's code expects what `python -m module` (the cwd) or `python script.py`
    # (the script's folder) puts there, and only an interpreter started on the script sets that.
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
    if module:
        guarded(lambda: runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True))
    else:
        guarded(lambda: runpy.run_path(sys.argv[0], run_name="__main__"))


if __name__ == "__main__":
    main(sys.argv[1:])
