"""The supervisor's progress watchdog: notice a job that stopped moving, and say who is behind.

The watchdog reads every rank's slot file (`_progress`) about twice a second and remembers, by
its own clock, when each last changed; it arms only once some rank recorded progress, so
start-up and the first compilation are never timed. A rank blocked outside a collective (a hung
read, a deadlock) leaves its peers waiting inside the next one, so the ranks with the fewest
steps are the ones to look at.
"""
from __future__ import annotations

import os
import signal
import time
from typing import NamedTuple

from jdp.launch import _progress

READ_EVERY_S = 0.5
STACK_WAIT_S = 3.0        # for faulthandler's dump to finish
MAX_STACKS = 4            # stuck ranks whose stacks are shown in full


class RankProgress(NamedTuple):
    """What a rank last recorded."""
    rank: int
    step: int            # steps run, -1 before its first
    phase: str           # "start" when it never recorded anything


class Watchdog:
    """Watches the slot files of a supervisor's ranks; `stalled()` says when and who."""

    def __init__(self, slots: dict, timeout_s: float):
        self.slots = slots                 # rank -> slot file path
        self.timeout_s = timeout_s
        self._seen: dict = {}              # rank -> last (count, step, phase)
        self._last_move: float | None = None
        self._next_read = 0.0

    def stalled(self, now: float) -> list | None:
        """Every rank's RankProgress when no rank moved for timeout_s; otherwise None."""
        if now >= self._next_read:
            self._next_read = now + READ_EVERY_S
            for rank, path in self.slots.items():
                value = _progress.read_slot(path)
                if value is not None and value[0] > 0 and value != self._seen.get(rank):
                    self._seen[rank] = value
                    self._last_move = now
        if self._last_move is None or now - self._last_move < self.timeout_s:
            return None
        return [RankProgress(rank, *self._seen.get(rank, (0, -1, "start"))[1:])
                for rank in sorted(self.slots)]


def behind(progress: list) -> list:
    """The ranks with the fewest steps (all of them when every rank is at the same step)."""
    low = min(p.step for p in progress)
    return [p for p in progress if p.step == low]


def describe(progress: list) -> str:
    """'rank 1 stuck at step 5 in phase data; rank 0 waiting at step 6 (phase step)'."""
    late = behind(progress)
    ahead = [p for p in progress if p not in late]
    parts = [f"rank {p.rank} stuck "
             f"{f'at step {p.step}' if p.step >= 0 else 'before its first step'} in phase {p.phase}"
             for p in late]
    if ahead:
        groups: dict = {}
        for p in ahead:
            groups.setdefault(p.step, []).append(str(p.rank))
        parts += [f"rank{'s' if len(r) > 1 else ''} {', '.join(r)} waiting at step {step}"
                  for step, r in sorted(groups.items())]
    return "; ".join(parts)


def dump_stacks(pids: dict, stack_files: dict) -> dict:
    """Ask each rank (rank -> pid) for its Python stacks (SIGUSR1); rank -> dump text.

    Only ranks whose runner set up the dump (its stack file exists) are signalled: SIGUSR1
    would kill a process that never registered a handler.
    """
    asked = {}
    for rank, pid in pids.items():
        path = stack_files[rank]
        if os.path.exists(path):
            try:
                os.kill(pid, signal.SIGUSR1)
                asked[rank] = path
            except ProcessLookupError:
                pass
    return {rank: _await_dump(path) for rank, path in asked.items()}


def _await_dump(path: str) -> str:
    """The dump in `path` once it stopped growing (or after STACK_WAIT_S)."""
    deadline, size = time.monotonic() + STACK_WAIT_S, -1
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = os.path.getsize(path)
        if now and now == size:
            break
        size = now
    with open(path, errors="replace") as f:
        return f.read()
