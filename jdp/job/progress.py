"""Progress and preemption signals shared by jdp's steps, the Loader and the Checkpointer.

Progress (`Progress`): under `jdp.launch` or `jdp.spawn` each rank owns a small file (its *slot*,
path in $JDP_PROGRESS_FILE) mapped into memory; `record(phase, step)` marks that the rank enters
`phase` and writes there a counter, the step, the phase, the time, the seconds spent so far
in each phase and, per step, when the rank reached it (a few struct writes, about a
microsecond, no system call). The supervisor's watchdog reads every slot to see who is moving
and who is behind, and `_goodput` to say where the time went and who arrives late. Under
srun or mpirun `jdp.initialize()` gives the slot an anonymous mapping (read by the peers that
ask where this rank is, and published by the in-job watchdog, `jdp.distributed._watch`).
Without either, `record` does nothing.

Preemption (`Preemption`): from its first call `preempted()` makes SIGTERM (from the launcher,
SLURM, Kubernetes, a spot VM's notice) only set a flag, which jdp's train step carries in the
all-reduce it already does and hands to `set_agreed`. A second SIGTERM (a second or more after
the first) or SIGKILL still ends the process.

Both are classes, one of each per process in `jdp.job.rank.current()`; the launcher side reads
slots through `read_slot` and the layout constants.
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

PHASES = ("start", "step", "data", "eval", "checkpoint", "other", "done", "wait")  # wait: at
# an agreement point (`jdp.distributed.agree`), for the other processes
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
DOUBLE = struct.Struct("<d")
DUPLICATE_SIGTERM_S = 1.0       # a SIGTERM this soon after the first is the same request
_CODES = {name: i for i, name in enumerate(PHASES)}

class Progress:
    """This rank's progress slot and the seconds it spent per phase (one per process:
    `jdp.job.rank.current().progress`)."""

    def __init__(self) -> None:
        self.slot: mmap.mmap | bool | None = None   # None: not opened yet; False: none
        self.count = 0
        self.step = -1
        self.last = 0.0                               # time of the last record
        self.charge = 0                               # accumulator the open interval goes to
        self.acc = [0.0] * (COMPILE + 1)
        self.first_calls = {1, 3}                     # step, eval: their first call compiles

    def record(self, phase: str, step: int | None = None) -> None:
        """Note that this rank enters `phase` ("step", "data", "eval", "checkpoint", "other").

        `step` is the number of training steps this process has run, when the caller knows
        it. The time since the previous record is added to the previous phase's total.
        """
        slot = self.slot if self.slot is not None else self.open_file()
        if slot is False:
            return
        now = time.monotonic()
        if self.count:
            self.acc[self.charge] += now - self.last
            DOUBLE.pack_into(slot, ACC_AT + 8 * self.charge, self.acc[self.charge])
            if self.charge == _CODES["checkpoint"] and phase != "checkpoint":   # a save ended
                KEPT.pack_into(slot, KEPT_AT, now, self.step, *self.acc)
        else:
            DOUBLE.pack_into(slot, FIRST_AT, now)
        code = _CODES.get(phase, 5)
        if step is not None and step != self.step:
            self.step = step
            DOUBLE.pack_into(slot, RING_AT + 8 * (step % RING), now)
        self.charge = code
        if code in self.first_calls:
            self.first_calls.discard(code)
            self.charge = COMPILE
        self.count += 1
        self.last = now
        HEAD.pack_into(slot, 0, self.count, self.step, code, now)

    def open_file(self) -> mmap.mmap | bool:
        """Map this rank's slot file ($JDP_PROGRESS_FILE), or False when there is none."""
        try:
            with open(os.environ[_env.PROGRESS_FILE], "r+b") as f:
                self.slot = mmap.mmap(f.fileno(), SLOT_SIZE)   # the map outlives the file
        except (KeyError, OSError, ValueError):
            self.slot = False
        if self.slot is not False:
            atexit.register(self.finished)   # after JAX's (LIFO): runs before its barrier
        return self.slot

    def memory_slot(self) -> mmap.mmap:
        """A slot in this process's memory, for a watchdog thread of this process to read
        (when no supervisor gave a slot file)."""
        if not isinstance(self.slot, mmap.mmap):
            self.slot = mmap.mmap(-1, SLOT_SIZE)
            atexit.register(self.finished)
        return self.slot

    def open(self) -> None:
        """Make sure this rank records its progress: the supervisor's slot file, else a slot
        in memory (a multi-process job's peers ask where this rank is: `jdp.job.peers`)."""
        if (self.slot if self.slot is not None else self.open_file()) is False:
            self.memory_slot()

    def current(self) -> tuple[int, int, str] | None:
        """(progress count, steps run or -1, phase) as last recorded; None without a slot."""
        if not isinstance(self.slot, mmap.mmap):
            return None
        return _head(*HEAD.unpack_from(self.slot)[:3])

    def finished(self) -> None:
        """At exit: this rank's own code is done (a peer still in a step will wait for it)."""
        if self.count:
            self.record("done")


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
    return None if data is None else _head(*SLOT.unpack(data))


def _head(count: int, step: int, code: int) -> tuple[int, int, str]:
    """(count, steps run, phase) of a slot's head. A slot nothing was recorded in yet is all
    zeros (the supervisor's fresh file, an anonymous map): it has run no step (-1), not step
    0, or a peer asking where a slow starter is would think it went past a call it has not
    reached yet."""
    if not count:
        return 0, -1, "start"
    return count, step, PHASES[code] if code < len(PHASES) else "other"


class Preemption:
    """This rank's stop request: SIGTERM's local flag and the decision every rank agreed in a
    train step's all-reduce (one per process: `jdp.job.rank.current().stop`)."""

    def __init__(self) -> None:
        self.local = False                 # SIGTERM arrived here
        self.first_at = 0.0
        self.agreed = False
        self.agreed_seen = False           # has a jdp step ever reported an agreed flag?
        self.handler_installed = False
        self.pending = None                # the newest step's agreed flag, read on demand

    def flag(self) -> bool:
        """True once this process was asked to stop (SIGTERM): a local, unagreed request."""
        return self.local

    def set_agreed(self, flag) -> None:
        """The stop decision every rank computed in the same step's all-reduce: a bool, or a
        function that reads it (called only when `preempted()` asks, off the step's path)."""
        if callable(flag):
            self.pending = flag
        else:
            self.agreed = self.agreed or bool(flag)
        self.agreed_seen = True

    def _read_agreed(self) -> bool:
        read, self.pending = self.pending, None
        if read is not None:
            self.agreed = self.agreed or bool(read())
        return self.agreed

    def preempted(self) -> bool:
        """`jdp.preempted()` (see `jdp.job.rank.preempted`)."""
        self._catch_sigterm()
        return self._read_agreed() if self.agreed_seen else self.local

    def _catch_sigterm(self) -> None:
        """Install the SIGTERM handler that sets the flag (main thread only, once)."""
        if self.handler_installed or threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.handler_installed = True

    def _on_sigterm(self, signum, frame) -> None:
        """First SIGTERM: set the flag. A later one (not a duplicate of the first): die of it."""
        now = time.monotonic()
        if not self.local:
            self.local, self.first_at = True, now
            return
        if now - self.first_at < DUPLICATE_SIGTERM_S:
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
