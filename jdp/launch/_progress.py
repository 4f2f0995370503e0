"""Progress and preemption signals shared by jdp's steps, the Loader and the Checkpointer.

Progress: under `jdp.launch` or `jdp.spawn` each rank owns a small file (its *slot*, path in
$JDP_PROGRESS_FILE) mapped into memory; `record(phase, step)` writes a counter, the step and
the phase there (one struct write, well under a microsecond, no system call), and the
supervisor's watchdog reads every slot to see who is moving and who is behind. Without a
supervisor `record` does nothing.

Preemption: from its first call `preempted()` makes SIGTERM (from the launcher, SLURM,
Kubernetes, a spot VM's notice) only set a flag, which jdp's train step carries in the
all-reduce it already does and hands to `set_agreed`. A second SIGTERM (a second or more after
the first) or SIGKILL still ends the process.
"""
from __future__ import annotations

import mmap
import os
import signal
import struct
import threading
import time

from jdp.launch import _env

PHASES = ("start", "step", "data", "eval", "checkpoint", "other")
SLOT = struct.Struct("<QqB")    # progress count, steps run (-1: none yet), phase index
SLOT_SIZE = 32
DUPLICATE_SIGTERM_S = 1.0       # a SIGTERM this soon after the first is the same request
_CODES = {name: i for i, name in enumerate(PHASES)}

_slot: mmap.mmap | bool | None = None     # None: not opened yet; False: no supervisor
_count = 0
_step = -1
_local_stop = False
_first_stop = 0.0
_agreed = False
_agreed_seen = False                       # has a jdp step ever reported an agreed flag?
_handler_installed = False
_pending_agreed: list = [None]           # the newest step's agreed flag, read on demand


def record(phase: str, step: int | None = None) -> None:
    """Note that this rank made progress (`phase`: "step", "data", "eval", "checkpoint").

    `step` is the number of training steps this process has run, when the caller knows it.
    """
    global _count, _step
    slot = _slot if _slot is not None else _open_slot()
    if slot is False:
        return
    _count += 1
    if step is not None:
        _step = step
    SLOT.pack_into(slot, 0, _count, _step, _CODES.get(phase, 5))


def _open_slot() -> mmap.mmap | bool:
    """Map this rank's slot file ($JDP_PROGRESS_FILE), or False when there is none."""
    global _slot
    try:
        with open(os.environ[_env.PROGRESS_FILE], "r+b") as f:
            _slot = mmap.mmap(f.fileno(), SLOT_SIZE)   # the map outlives the file
    except (KeyError, OSError, ValueError):
        _slot = False
    return _slot


def read_slot(path: str) -> tuple[int, int, str] | None:
    """(progress count, steps run or -1, phase) from a slot file; None if unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read(SLOT.size)
    except OSError:
        return None
    if len(data) < SLOT.size:
        return None
    count, step, code = SLOT.unpack(data)
    return count, step, PHASES[code] if code < len(PHASES) else "other"


def stop_flag() -> bool:
    """True once this process was asked to stop (SIGTERM): a local, unagreed request."""
    return _local_stop


def set_agreed(flag) -> None:
    """The stop decision every rank computed in the same step's all-reduce: a bool, or a
    function that reads it (called only when `preempted()` asks, off the step's path)."""
    global _agreed, _agreed_seen
    if callable(flag):
        _pending_agreed[0] = flag
    else:
        _agreed = _agreed or bool(flag)
    _agreed_seen = True


def _read_agreed() -> bool:
    global _agreed
    read, _pending_agreed[0] = _pending_agreed[0], None
    if read is not None:
        _agreed = _agreed or bool(read())
    return _agreed


def preempted() -> bool:
    """True once this job was asked to stop (SIGTERM to the launcher or to any rank).

    Call it once per iteration of the training loop; on every rank it turns True at the same
    iteration, agreed through the train step's own all-reduce (no extra collective), so all
    ranks can save one checkpoint at one step and leave:

        for batch in loader:
            state, metrics = step(state, batch)
            if jdp.preempted():
                ckpt.save(step_count, state, loader=loader)
                break

    The first call makes this process catch SIGTERM (until then SIGTERM ends it as usual).
    Before any jdp train step has run (or with no step at all, e.g. a single process's own
    loop) it is this process's own flag, not an agreed one.
    """
    _catch_sigterm()
    return _read_agreed() if _agreed_seen else _local_stop


def _catch_sigterm() -> None:
    """Install the SIGTERM handler that sets the stop flag (main thread only, once)."""
    global _handler_installed
    if _handler_installed or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    _handler_installed = True


def _on_sigterm(signum, frame) -> None:
    """First SIGTERM: set the flag. A later one (not a duplicate of the first): die of it."""
    global _local_stop, _first_stop
    now = time.monotonic()
    if not _local_stop:
        _local_stop, _first_stop = True, now
        return
    if now - _first_stop < DUPLICATE_SIGTERM_S:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
