"""Where a job's time went, and which rank arrives late: read from the ranks' progress slots.

Each rank's slot (`_progress`) holds the seconds it spent in each phase, when it first and
last recorded, and when it reached each of its last steps. The supervisor reads them about
twice a second (no collective, nothing on the ranks' path) and at each round's end; this
module turns them into

- **buckets** that add up to the wall time: start-up and compilation (from the launch to a
  rank's first record, plus the first call of each jitted step), training steps, waiting for
  data, evaluation, checkpoints, failures and restarts (every round that ended in a failure,
  and the pause after it), and other (the rest: the user's own code between jdp calls, the
  launcher's own work, a rank that finished waiting for its peers);
- **stragglers**: a rank whose median lag in reaching a step, behind the first rank there,
  exceeds STRAGGLER_FRACTION of the median step time (and MIN_LAG_S), with its lag and its
  slowest phase
  (the phase where it spends the most time beyond the other ranks' median).

`Ledger` keeps a job's rounds; `summary` is what goes to LOGDIR/summary.json and `line` the
one `goodput` line the launcher prints.
"""
from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import time
from typing import NamedTuple

from jdp.launch import _profile_opts, _progress

STRAGGLER_FRACTION = 0.2   # median lag / median step time that names a straggler
MIN_LAG_S = 0.01           # and by at least this much: below, it is scheduling noise
MIN_STEPS = 5              # steps seen on every rank before anyone is named
WARN_EVERY_S = 60.0        # at most one straggler warning a minute while the job runs
BUCKETS = ("startup", "steps", "data", "eval", "checkpoint", "failures", "other")
_PHASE_BUCKET = {"start": "other", "step": "steps", "data": "data", "eval": "eval",
                 "checkpoint": "checkpoint", "other": "other", "done": "other"}
_LABELS = {"startup": "start-up+compile", "steps": "steps", "data": "data", "eval": "eval",
           "checkpoint": "checkpoints", "failures": "failures", "other": "other"}


class RankTimes(NamedTuple):
    """One rank's slot, as read."""
    count: int                 # records so far (0: none)
    step: int
    phase: str
    first: float               # time.monotonic() of its first and last records
    last: float
    seconds: dict              # phase (and "compile") -> seconds, closed intervals only
    arrivals: dict             # step -> time.monotonic() it was reached (the last RING steps)


def read(path: str) -> RankTimes | None:
    """The slot file at `path`, or None when it cannot be read."""
    data = _progress.slot_bytes(path, _progress.SLOT_SIZE)
    if data is None:
        return None
    count, step, code, last = _progress.HEAD.unpack_from(data)
    first = _progress._DOUBLE.unpack_from(data, _progress.FIRST_AT)[0]
    acc = [_progress._DOUBLE.unpack_from(data, _progress.ACC_AT + 8 * i)[0]
           for i in range(_progress.COMPILE + 1)]
    arrivals = {}
    for k in range(max(1, step - _progress.RING + 1), step + 1):
        t = _progress._DOUBLE.unpack_from(data, _progress.RING_AT + 8 * (k % _progress.RING))[0]
        if t > 0:
            arrivals[k] = t
    phases = _progress.PHASES
    return RankTimes(count, step, phases[code] if code < len(phases) else "other", first,
                     last, {**dict(zip(phases, acc, strict=False)), "compile": acc[-1]},
                     arrivals)


class Stragglers:
    """Collects, step by step, how long after the first rank each rank reached it."""

    def __init__(self, ranks: list):
        self.ranks = list(ranks)
        self.pending: dict = {}                                  # step -> {rank: time}
        self.lags = {r: collections.deque(maxlen=1000) for r in self.ranks}
        self.step_s: collections.deque = collections.deque(maxlen=1000)
        self.done: dict = {}                                     # step -> first arrival
        self.latest = 0

    def feed(self, times: dict) -> None:
        """Add what the slots (rank -> RankTimes) show now."""
        for rank, t in times.items():
            for step, at in t.arrivals.items():
                if step > self.latest:
                    self.pending.setdefault(step, {})[rank] = at
        for step in sorted(self.pending):
            arrived = self.pending[step]
            if len(arrived) < len(self.ranks):
                continue
            first = min(arrived.values())
            for rank, at in arrived.items():
                self.lags[rank].append(at - first)
            if step - 1 in self.done:
                self.step_s.append(first - self.done[step - 1])
            self.done = {step: first}
            self.latest = max(self.latest, step)
            del self.pending[step]
        self.pending = {s: a for s, a in self.pending.items() if s > self.latest}

    def named(self, seconds: dict) -> list:
        """The stragglers: [{"rank", "lag_s", "lag_of_step", "slowest_phase"}], latest first."""
        if len(self.step_s) < MIN_STEPS - 1 or len(self.ranks) < 2:
            return []
        step = statistics.median(self.step_s)
        found = []
        for rank in self.ranks:
            lag = statistics.median(self.lags[rank])
            if step > 0 and lag > max(STRAGGLER_FRACTION * step, MIN_LAG_S):
                found.append({"rank": rank, "lag_s": round(lag, 4),
                              "lag_of_step": round(lag / step, 3),
                              "median_step_s": round(step, 4),
                              "slowest_phase": _slowest_phase(rank, seconds)})
        return sorted(found, key=lambda s: -s["lag_s"])


def _slowest_phase(rank: int, seconds: dict) -> str:
    """The phase where `rank` spends the most beyond the median of the other ranks."""
    others = [s for r, s in seconds.items() if r != rank]
    if rank not in seconds or not others:
        return "unknown"
    excess = {p: seconds[rank].get(p, 0.0) - statistics.median(o.get(p, 0.0) for o in others)
              for p in ("step", "data", "eval", "checkpoint", "other")}
    return max(excess, key=excess.get)


def warning(who: str, stragglers: list) -> str:
    """'jdp.launch: straggler: rank 1 reaches each step 0.16 s (105 % of a step) after ...'."""
    return "; ".join(f"{who}: straggler: rank {s['rank']} reaches each step {s['lag_s']:.3g} s "
                     f"({100 * s['lag_of_step']:.0f} % of a {s['median_step_s']:.3g} s step) "
                     f"after the first rank; its slowest phase: {s['slowest_phase']}"
                     for s in stragglers)


def rank_buckets(t: RankTimes | None, start: float, exited: float, end: float) -> dict:
    """One rank's seconds per bucket over one round [start, end]; they add up to end - start."""
    out = dict.fromkeys(BUCKETS, 0.0)
    if t is None or t.count == 0:
        out["startup"] = exited - start
        out["other"] = end - exited
        return out
    out["startup"] = max(0.0, t.first - start) + t.seconds["compile"]
    for phase, bucket in _PHASE_BUCKET.items():
        out[bucket] += t.seconds[phase]
    out[_PHASE_BUCKET[t.phase]] += max(0.0, exited - t.last)     # the interval still open
    out["other"] += max(0.0, end - max(exited, t.last))
    return out


class Ledger:
    """A job's rounds, as one node's supervisor saw them; prints and writes the summary."""

    def __init__(self, who: str, logdir: str | None = None, node: int = 0,
                 from_process_start: bool = True):
        self.who, self.logdir, self.node = who, logdir, node
        # The launcher's wall time includes its own start-up; jdp.spawn's starts at the call.
        self.start = _process_start() if from_process_start else time.monotonic()
        self.per_rank: dict = {}          # rank -> bucket -> seconds (closed rounds)
        self.detail: dict = {}            # rank -> phase seconds (the last round)
        self.stragglers: list = []
        self.rounds = 0
        self._round: tuple | None = None  # (start, slots, Stragglers, exits)
        self._next_warning = 0.0
        self._end = self.start
        self._failed_last = False
        self._writer = None
        if logdir:   # opened now: its imports count in the wall time, its events show at once
            from jdp.metrics import Writer  # no JAX backend: primary=True
            self._writer = Writer(os.path.join(logdir, "goodput" if node == 0
                                               else f"goodput.node{node}"), primary=True)

    def begin(self, slots: dict) -> None:
        """A round starts: rank -> slot file path. After a failed round, say where the time
        went so far (the failure's report is out by now)."""
        if self._failed_last:
            self.say()
        self._round = (time.monotonic(), dict(slots), Stragglers(sorted(slots)), {})
        self._next_warning = time.monotonic() + WARN_EVERY_S

    def exited(self, rank: int, now: float) -> None:
        if self._round is not None:
            self._round[3].setdefault(rank, now)

    def sample(self, now: float) -> str | None:
        """Read the slots; a straggler warning at most once a minute, else None."""
        if self._round is None:
            return None
        times = self._read()
        self._round[2].feed(times)
        if now < self._next_warning:
            return None
        named = self._round[2].named({r: t.seconds for r, t in times.items()})
        if not named:
            return None
        self._next_warning = now + WARN_EVERY_S
        return warning(self.who, named)

    def _read(self) -> dict:
        return {r: t for r, path in self._round[1].items() if (t := read(path)) is not None}

    def end(self, failed: bool) -> None:
        """The round is over (its slots still on disk): add it to the job's buckets."""
        if self._round is None:
            return
        start, slots, stragglers, exits = self._round
        now = time.monotonic()
        times = self._read()
        stragglers.feed(times)
        self._add_gap(start)
        for rank in slots:
            t = times.get(rank)
            b = rank_buckets(t, start, min(exits.get(rank, now), now), now)
            if failed:
                b = {**dict.fromkeys(BUCKETS, 0.0), "failures": now - start}
            self._add(rank, b)
            if t is not None:
                self.detail[rank] = {**t.seconds, "steps_run": max(t.step, 0)}
        self.stragglers = stragglers.named({r: t.seconds for r, t in times.items()}) or (
            self.stragglers if failed else [])
        self.rounds += 1
        self._end, self._failed_last, self._round = now, failed, None

    def _add(self, rank: int, buckets: dict) -> None:
        mine = self.per_rank.setdefault(rank, dict.fromkeys(BUCKETS, 0.0))
        for k, v in buckets.items():
            mine[k] += v

    def _add_gap(self, start: float) -> None:
        """The time between the previous round's end (or the job's start) and this round."""
        gap = max(0.0, start - self._end)
        for rank in self.per_rank:   # the first round's gap is "other" (see summary)
            self.per_rank[rank]["failures" if self._failed_last else "other"] += gap

    def summary(self) -> dict:
        """{"wall_s", "buckets_s", "goodput", "stragglers", "ranks": {rank: detail}}."""
        now = time.monotonic()
        wall = now - self.start
        ranks = {}
        for rank, b in sorted(self.per_rank.items()):
            b = dict(b)
            b["other"] += wall - sum(b.values())        # before the first round, after the last
            ranks[rank] = {"buckets_s": _rounded(b),
                           "phases_s": _rounded(self.detail.get(rank, {}))}
        n = max(1, len(ranks))
        total = {k: sum(r["buckets_s"][k] for r in ranks.values()) / n for k in BUCKETS}
        return {"wall_s": round(wall, 3), "buckets_s": _rounded(total),
                "goodput": round(total["steps"] / wall, 4) if wall > 0 else 0.0,
                "rounds": self.rounds, "stragglers": self.stragglers,
                "ranks": {str(r): d for r, d in ranks.items()},
                "profiles": _profile_opts.trace_files(self.logdir)}

    def line(self, summary: dict | None = None) -> str:
        """The one `goodput` line."""
        s = summary or self.summary()
        b = s["buckets_s"]
        parts = ", ".join(f"{_LABELS[k]} {b[k]:.1f} s" for k in BUCKETS)
        text = (f"{self.who}: goodput {100 * s['goodput']:.1f} % of {s['wall_s']:.1f} s "
                f"wall: {parts}")
        if s["stragglers"]:
            text += "; " + "; ".join(
                f"straggler rank {x['rank']} ({x['lag_s']:.3g} s behind per step, "
                f"{100 * x['lag_of_step']:.0f} % of a step; slowest phase {x['slowest_phase']})"
                for x in s["stragglers"])
        if s.get("profiles"):   # --profile_steps: where the ranks' traces went
            text += "; " + _profile_opts.describe(s["profiles"])
        return text

    def say(self) -> None:
        if self.per_rank:
            print(self.line(), file=sys.stderr, flush=True)

    def finish(self) -> dict | None:
        """At the job's end: print the line; write LOGDIR/summary.json and the metrics."""
        if not self.per_rank:
            return None
        s = self.summary()
        print(self.line(s), file=sys.stderr, flush=True)
        if self.logdir:
            write(self.logdir, s, self.node, self._writer)
        return s


def write(logdir: str, summary: dict, node: int = 0, writer=None) -> str:
    """LOGDIR/summary.json (summary.nodeK.json on node K > 0), and the figures through
    `writer` (a `jdp.metrics.Writer`; JSON lines, TensorBoard when tensorboardX is installed),
    which this closes."""
    os.makedirs(logdir, exist_ok=True)
    path = os.path.join(logdir, "summary.json" if node == 0 else f"summary.node{node}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(path + ".tmp", path)
    figures = {f"goodput/{k}_s": v for k, v in summary["buckets_s"].items()}
    figures.update({"goodput/wall_s": summary["wall_s"], "goodput/fraction": summary["goodput"]})
    for s in summary["stragglers"]:
        figures[f"stragglers/rank{s['rank']}_lag_s"] = s["lag_s"]
    if writer is not None:
        writer.scalars(summary["rounds"], figures)
        writer.close()
    return path


def _process_start() -> float:
    """When this process started, on time.monotonic()'s clock (Linux; else: now), so the wall
    time includes the launcher's own start-up (importing JAX takes seconds)."""
    now = time.monotonic()
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22: start time
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - age if 0 <= age < 3600 else now


def _rounded(d: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}
