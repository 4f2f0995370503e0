"""Leaving a rank promptly with its own exit status, and describing exit statuses.

Why this exists: once `jax.distributed` is initialised, JAX's atexit handler waits in a
shutdown barrier for every peer, so a rank that raises or calls `sys.exit(3)` would hang (up to
the shutdown timeout) and then die by SIGABRT, losing its exit code. A failing rank prints its
traceback, flushes, and leaves with `os._exit(code)` at once. Standard library only: the
rank-side runner (jdp/_run.py) loads it before jax may be imported.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
import traceback
from typing import NoReturn

LOST_PEER_DELAY_S = 1.0
_LOST_PEER = re.compile(r"gloo|nccl|connection (closed|reset) by peer|coordination service",
                        re.IGNORECASE)
_ERROR_FILE = "JDP_ERROR_FILE"   # jdp._env.ERROR_FILE (not imported: see jdp/_run.py)


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
    path = os.environ.get(_ERROR_FILE)
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
    """`tb` without its leading frames in jdp's runner and runpy, as `python script.py` shows."""
    runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_run.py")
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (name == "<frozen runpy>" or name.endswith(os.sep + "runpy.py")
                or os.path.abspath(name) == runner):
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
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    return 1


def exit_status(returncode: int) -> int:
    """A shell-style exit status from a Popen return code: the code, or 128+N for signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'signal SIGKILL (exit status 137)', from a Popen return code."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = str(-returncode)
    return f"signal {name} (exit status {exit_status(returncode)})"
