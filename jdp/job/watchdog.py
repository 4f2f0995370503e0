"""The supervisor's progress watchdog: notice a job that stopped moving, and say who is behind.

The watchdog reads every rank's slot file (`_progress`) about twice a second and remembers, by
its own clock, when each last changed; it arms once some rank recorded progress (a step, a
batch, a checkpoint, or a wait at an agreement point), so the first compilation is timed only
from there. Until then a round's start-up gets `startup_s` (default STARTUP_S, or
JDP_STARTUP_TIMEOUT), never less than the progress timeout: ranks that never record (stuck
in their imports, or in a collective before any jdp call) are named with their stacks too.
A rank blocked outside a collective (a hung read, a deadlock) leaves its peers waiting inside
the next one, so the ranks with the fewest steps are the ones to look at. A rank whose code
finished (phase "done", recorded at its exit) while another waits in a later step than it ran
is named at once (FINISHED_WAIT_S): that step can never complete.

Stacks are shown as a traceback shows them: most recent call last, each frame with its source
line, without the launcher's own frames (runpy, `run.py`), so the user's code comes first.
"""
from __future__ import annotations

import linecache
import os
import re
import signal
import time
import traceback
from typing import NamedTuple

from jdp.job import progress as _progress
from jdp.job.run import LAUNCHER_DIRS

READ_EVERY_S = 0.5
STACK_WAIT_S = 3.0        # for faulthandler's dump to finish
MAX_STACKS = 4            # stuck ranks whose stacks are shown in full
FINISHED_WAIT_S = 2.0     # a finished rank and a peer in a later step, unmoved this long
STARTUP_S = 600.0         # the most a round waits for its first record (JDP_STARTUP_TIMEOUT)
_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (.*)$')


class RankProgress(NamedTuple):
    """What a rank last recorded."""
    rank: int
    step: int            # steps run, -1 before its first
    phase: str           # "start" when it never recorded anything


class Watchdog:
    """Watches the slot files of a supervisor's ranks; `stalled()` says when and who."""

    def __init__(self, slots: dict, timeout_s: float | None, startup_s: float | None = None):
        self.slots = slots                 # rank -> slot file path
        self.timeout_s = timeout_s
        self.startup_s = max(timeout_s or 0.0, startup_s or STARTUP_S)
        self._started = time.monotonic()
        self._seen: dict = {}              # rank -> last (count, step, phase)
        self._last_move: float | None = None
        self._next_read = 0.0

    def progress(self) -> list:
        """Every rank's RankProgress as last read."""
        return [RankProgress(rank, *self._seen.get(rank, (0, -1, "start"))[1:])
                for rank in sorted(self.slots)]

    def abandoned(self, now: float) -> str | None:
        """'rank 0 finished at step 3; rank 1 waits in step 4' when a finished rank left a peer
        in a step it never ran (and nobody moved for FINISHED_WAIT_S); else None."""
        if self._last_move is None or now - self._last_move < FINISHED_WAIT_S:
            return None
        return finished_early(self.progress())

    def stalled(self, now: float) -> list | None:
        """Every rank's RankProgress when no rank moved for timeout_s; otherwise None."""
        if now >= self._next_read:
            self._next_read = now + READ_EVERY_S
            for rank, path in self.slots.items():
                value = _progress.read_slot(path)
                if value is not None and value[0] > 0 and value != self._seen.get(rank):
                    self._seen[rank] = value
                    self._last_move = now
        if self.timeout_s is None:
            return None
        if self._last_move is None:   # start-up: no rank recorded anything yet
            return self.progress() if now - self._started >= self.startup_s else None
        return self.progress() if now - self._last_move >= self.timeout_s else None


def finished_early(progress: list) -> str | None:
    """The finished ranks and the peers left waiting in a later step, or None."""
    done = [p for p in progress if p.phase == "done"]
    if not done:
        return None
    least = min(p.step for p in done)
    waiting = [p for p in progress if p.phase != "done" and p.step > least]
    if not waiting:
        return None
    return "; ".join([f"rank {p.rank} finished at step {p.step}" for p in done]
                     + [f"rank {p.rank} waits in {p.phase} {p.step}" if p.phase != "step"
                        else f"rank {p.rank} waits in step {p.step}" for p in waiting])


def behind(progress: list) -> list:
    """The ranks with the fewest steps (all of them when every rank is at the same step)."""
    low = min(p.step for p in progress)
    return [p for p in progress if p.step == low]


def readable(dump: str) -> str:
    """A faulthandler dump as a traceback: oldest call first, each frame's source line, the
    launcher's frames left out."""
    out, frames, header = [], [], None

    def close():
        if header is not None:
            out.append(header.replace("most recent call first", "most recent call last"))
            out.extend(_frame_lines(list(reversed(frames))))

    for line in dump.splitlines():
        match = _FRAME.match(line)
        if match:
            frames.append((match[1], int(match[2]), match[3]))
        elif line.strip():
            close()
            header, frames = line.rstrip(), []
    close()
    return "\n".join(out)


def frame_summary(frame) -> str:
    """The stack of a live frame (another thread's), as `readable` shows a dump."""
    entries = [(f.f_code.co_filename, lineno, f.f_code.co_name)
               for f, lineno in traceback.walk_stack(frame)]
    return "\n".join(_frame_lines(list(reversed(entries))))


def _frame_lines(frames: list) -> list:
    """'  File "x.py", line 3, in f' and its source line, per frame, the launcher's dropped."""
    while frames and _launcher_frame(frames[0][0]):
        frames = frames[1:]
    lines = []
    for filename, lineno, name in frames:
        lines.append(f'  File "{filename}", line {lineno}, in {name}')
        if source := linecache.getline(filename, lineno).strip():
            lines.append(f"    {source}")
    return lines


def _launcher_frame(filename: str) -> bool:
    return (filename == "<frozen runpy>" or filename.endswith(os.sep + "runpy.py")
            or os.path.dirname(os.path.abspath(filename)) in LAUNCHER_DIRS)


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
        return readable(f.read())
