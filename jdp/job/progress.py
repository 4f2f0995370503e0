"""Progress and preemption signals shared by jdp's steps, the Loader and the Checkpointer.

Progress: under `jdp.launch` or `jdp.spawn` each rank owns a small file (its *slot*, path in
$JDP_PROGRESS_FILE) mapped into memory; `record(phase, step)` marks that the rank enters
`phase` and writes there a counter, the step, the phase, the time, the seconds spent so far
in each phase and, per step, when the rank reached it (a few struct writes, about a
microsecond, no system call). The supervisor's watchdog reads every slot to see who is moving
and who is behind, and `_goodput` to say where the time went and who arrives late. Under
srun or mpirun `jdp.initialize()` gives the slot an anonymous mapping, which its watchdog
thread publishes (`jdp.distributed._watch`). Without either, `record` does nothing.

Preemption: from its first call `preempted()` makes SIGTERM (from the launcher, SLURM,
Kubernetes, a spot VM's notice) only set a flag, which jdp's train step carries in the
all-reduce it already does and hands to `set_agreed`. A second SIGTERM (a second or more after
the first) or SIGKILL still ends the process.
"""
from __future__ import annotations

import atexit
import mmap
import os
import signal
import struct
import threading
import time

from jdp.job import env as _env

PHASES = ("start", "step", "data", "eval", "checkpoint", "other", "done")
COMPILE = len(PHASES)            # the accumulator of a jitted step's first call (compilation)
SLOT = struct.Struct("<QqB")    # progress count, steps run (-1: none yet), phase index
# The slot: SLOT and the time of the last record (HEAD), the first record's time, seconds
# spent per phase (COMPILE last), then a ring of the times the rank reached its last RING steps.
HEAD = struct.Struct("<QqB7xd")
FIRST_AT, ACC_AT = HEAD.size, HEAD.size + 8
RING = 64
RING_AT = ACC_AT + 8 * (COMPILE + 1)
# When the last checkpoint save or restore ended: its time, the steps run, the seconds per
# phase then (goodput keeps a failed round's work up to there and counts the rest lost).
KEPT = struct.Struct(f"<dq{COMPILE + 1}d")
KEPT_AT = RING_AT + 8 * RING
SLOT_SIZE = KEPT_AT + KEPT.size
_DOUBLE = struct.Struct("<d")
DUPLICATE_SIGTERM_S = 1.0       # a SIGTERM this soon after the first is the same request
_CODES = {name: i for i, name in enumerate(PHASES)}

_slot: mmap.mmap | bool | None = None     # None: not opened yet; False: no supervisor
_count = 0
_step = -1
_last = 0.0                                # time of the last record
_charge = 0                                # accumulator the open interval goes to
_acc = [0.0] * (COMPILE + 1)
_first_calls = {1, 3}                      # step, eval: their first call compiles
_local_stop = False
_first_stop = 0.0
_agreed = False
_agreed_seen = False                       # has a jdp step ever reported an agreed flag?
_handler_installed = False
_pending_agreed: list = [None]           # the newest step's agreed flag, read on demand


def record(phase: str, step: int | None = None) -> None:
    """Note that this rank enters `phase` ("step", "data", "eval", "checkpoint", "other").

    `step` is the number of training steps this process has run, when the caller knows it.
    The time since the previous record is added to the previous phase's total.
    """
    global _count, _step, _last, _charge
    slot = _slot if _slot is not None else _open_slot()
    if slot is False:
        return
    now = time.monotonic()
    if _count:
        _acc[_charge] += now - _last
        _DOUBLE.pack_into(slot, ACC_AT + 8 * _charge, _acc[_charge])
        if _charge == _CODES["checkpoint"] and phase != "checkpoint":   # a save ended
            KEPT.pack_into(slot, KEPT_AT, now, _step, *_acc)
    else:
        _DOUBLE.pack_into(slot, FIRST_AT, now)
    code = _CODES.get(phase, 5)
    if step is not None and step != _step:
        _step = step
        _DOUBLE.pack_into(slot, RING_AT + 8 * (step % RING), now)
    _charge = code
    if code in _first_calls:
        _first_calls.discard(code)
        _charge = COMPILE
    _count += 1
    _last = now
    HEAD.pack_into(slot, 0, _count, _step, code, now)


def _open_slot() -> mmap.mmap | bool:
    """Map this rank's slot file ($JDP_PROGRESS_FILE), or False when there is none."""
    global _slot
    try:
        with open(os.environ[_env.PROGRESS_FILE], "r+b") as f:
            _slot = mmap.mmap(f.fileno(), SLOT_SIZE)   # the map outlives the file
    except (KeyError, OSError, ValueError):
        _slot = False
    if _slot is not False:
        atexit.register(_finished)   # after JAX's (LIFO): runs before its shutdown barrier
    return _slot


def memory_slot() -> mmap.mmap:
    """A slot in this process's memory, for a watchdog thread of this process to read
    (when no supervisor gave a slot file)."""
    global _slot
    if not isinstance(_slot, mmap.mmap):
        _slot = mmap.mmap(-1, SLOT_SIZE)
        atexit.register(_finished)
    return _slot


def _finished() -> None:
    """At exit: this rank's own code is done (a peer still in a step will wait for it)."""
    if _count:
        record("done")


def slot_bytes(path: str, size: int) -> bytes | None:
    """The first `size` bytes of a slot file; None when it cannot be read (yet)."""
    try:
        with open(path, "rb") as f:
            data = f.read(size)
    except OSError:
        return None
    return data if len(data) >= size else None


def read_slot(path: str) -> tuple[int, int, str] | None:
    """(progress count, steps run or -1, phase) from a slot file; None if unreadable."""
    data = slot_bytes(path, SLOT.size)
    if data is None:
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
