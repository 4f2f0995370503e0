"""Where a job's time went, and which rank arrives late: read from the ranks' progress slots.

Each rank's slot (`_progress`) holds the seconds it spent in each phase, when it first and
last recorded, and when it reached each of its last steps. The supervisor reads them about
twice a second (no collective, nothing on the ranks' path) and at each round's end; this
module turns them into

- **buckets** that add up to the wall time: start-up and compilation (from the launch to a
  rank's first record, plus the first call of each jitted step), training steps, waiting for
  data, evaluation, checkpoints, lost work (in a round that ended in a failure, the work
  after its last complete checkpoint, which the next round redoes, and the pause before the
  restart: the rest of that round is split like any other), and other (the rest: the user's
  own code between jdp calls, the launcher's own work, a rank that finished waiting for its
  peers);
- **stragglers**: a rank whose median lag in reaching a step, behind the first rank there,
  exceeds STRAGGLER_FRACTION of the median step time (and MIN_LAG_S), with its lag and its
  slowest phase
  (the phase where it spends the most time beyond the other ranks' median).

`Ledger` keeps a job's rounds; `summary` is what goes to LOGDIR/summary.json and `line` the
one `goodput` line the launcher prints; on a job of several nodes, `merge` makes node 0's
summary the job's from every node's.
"""
from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import time
import types
from typing import NamedTuple

from jdp.job import progress as _progress
from jdp.launch import _profile_opts

STRAGGLER_FRACTION = 0.2   # median lag / median step time that names a straggler
MIN_LAG_S = 0.01           # and by at least this much: below, it is scheduling noise
MIN_STEPS = 5              # steps seen on every rank before anyone is named
WARN_EVERY_S = 60.0        # at most one straggler warning a minute while the job runs
BUCKETS = ("startup", "steps", "data", "eval", "checkpoint", "lost", "other")
_PHASE_BUCKET = {"start": "other", "step": "steps", "data": "data", "eval": "eval",
                 "checkpoint": "checkpoint", "other": "other", "done": "other", "wait": "other"}
_LABELS = {"startup": "start-up+compile", "steps": "steps", "data": "data", "eval": "eval",
           "checkpoint": "checkpoints", "lost": "lost work", "other": "other"}


class RankTimes(NamedTuple):
    """One rank's slot, as read."""
    count: int                 # records so far (0: none)
    step: int
    phase: str
    first: float               # time.monotonic() of its first and last records
    last: float
    seconds: dict              # phase (and "compile") -> seconds, closed intervals only
    arrivals: dict             # step -> time.monotonic() it was reached (the last RING steps)
    kept: tuple | None = None  # the last checkpoint's end: (time, steps run, seconds)


def read(path: str) -> RankTimes | None:
    """The slot file at `path`, or None when it cannot be read."""
    data = _progress.slot_bytes(path, _progress.SLOT_SIZE)
    if data is None:
        return None
    count, step, code, last = _progress.HEAD.unpack_from(data)
    first = _progress.DOUBLE.unpack_from(data, _progress.FIRST_AT)[0]
    acc = [_progress.DOUBLE.unpack_from(data, _progress.ACC_AT + 8 * i)[0]
           for i in range(_progress.COMPILE + 1)]
    arrivals = {}
    for k in range(max(1, step - _progress.RING + 1), step + 1):
        t = _progress.DOUBLE.unpack_from(data, _progress.RING_AT + 8 * (k % _progress.RING))[0]
        if t > 0:
            arrivals[k] = t
    phases = _progress.PHASES
    at, kept_step, *kept_acc = _progress.KEPT.unpack_from(data, _progress.KEPT_AT)
    return RankTimes(count, step, phases[code] if code < len(phases) else "other", first,
                     last, _seconds(acc), arrivals,
                     (at, kept_step, _seconds(kept_acc)) if at > 0 else None)


def _seconds(acc: list) -> dict:
    """Phase (and "compile") -> seconds, from the slot's accumulators."""
    return {**dict(zip(_progress.PHASES, acc, strict=False)), "compile": acc[-1]}


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


def failed_buckets(t: RankTimes | None, start: float, end: float) -> tuple[dict, int]:
    """One rank's buckets over a round [start, end] that ended in a failure, and the steps it
    ran after its last complete checkpoint: the work up to that checkpoint is split like any
    round's, the rest is lost work (the next round, resuming from it, does it again)."""
    if t is None or t.count == 0:
        return {**dict.fromkeys(BUCKETS, 0.0), "lost": end - start}, 0
    if t.kept is None or t.kept[0] < start:   # no checkpoint: only the start-up is kept
        kept_at, kept_step, seconds = t.first, 0, dict.fromkeys(t.seconds, 0.0)
    else:
        kept_at, kept_step, seconds = t.kept
    kept_at = min(kept_at, end)
    upto = t._replace(last=kept_at, phase="other", seconds=seconds)
    out = rank_buckets(upto, start, kept_at, kept_at)
    out["lost"] = end - kept_at
    return out, max(0, t.step - max(kept_step, 0))


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
        self.lost_steps: list = []        # per failed round: the steps run after its checkpoint
        self.nodes: dict = {}             # node 0: node k -> node k's summary (`merge`)
        self.arrivals: dict = {}          # the last round's, on the wall clock (`merge`)
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
        lost_steps = []
        for rank in slots:
            t = times.get(rank)
            if failed:
                b, lost = failed_buckets(t, start, now)
                lost_steps.append(lost)
            else:
                b = rank_buckets(t, start, min(exits.get(rank, now), now), now)
            self._add(rank, b)
            if t is not None:
                self.detail[rank] = {**t.seconds, "steps_run": max(t.step, 0)}
        self.stragglers = stragglers.named({r: t.seconds for r, t in times.items()}) or (
            self.stragglers if failed else [])
        self.rounds += 1
        self.arrivals = _wall_clock_arrivals(times)
        if failed:   # the steps every rank ran (one ahead may have begun a step it never ends)
            self.lost_steps.append(min(lost_steps, default=0))
        self._end, self._failed_last, self._round = now, failed, None

    def _add(self, rank: int, buckets: dict) -> None:
        mine = self.per_rank.setdefault(rank, dict.fromkeys(BUCKETS, 0.0))
        for k, v in buckets.items():
            mine[k] += v

    def _add_gap(self, start: float) -> None:
        """The time between the previous round's end (or the job's start) and this round."""
        gap = max(0.0, start - self._end)
        for rank in self.per_rank:   # the first round's gap is "other" (see summary)
            self.per_rank[rank]["lost" if self._failed_last else "other"] += gap

    def summary(self, arrivals: bool = False) -> dict:
        """{"wall_s", "buckets_s", "goodput", "rounds", "lost_steps" (per failed round),
        "stragglers", "ranks": {rank: detail}}; on node 0 of several, the job's (`merge`).
        With `arrivals`, also the last round's step arrivals (what node k sends node 0)."""
        own = self._own_summary()
        if arrivals:
            own["arrivals"] = self.arrivals
        return merge({**own, "arrivals": self.arrivals}, self.nodes) if self.nodes else own

    def _own_summary(self) -> dict:
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
                "rounds": self.rounds, "lost_steps": self.lost_steps,
                "last_round_failed": self._failed_last, "stragglers": self.stragglers,
                "ranks": {str(r): d for r, d in ranks.items()},
                "profiles": _profile_opts.trace_files(self.logdir)}

    def line(self, summary: dict | None = None) -> str:
        """The one `goodput` line."""
        s = summary or self.summary()
        b = s["buckets_s"]
        parts = ", ".join(f"{_LABELS[k]} {b[k]:.1f} s" for k in BUCKETS)
        parts += _redone(s.get("lost_steps") or [], s.get("last_round_failed", False))
        nodes = f" on {len(s['nodes'])} nodes" if "nodes" in s else ""
        text = (f"{self.who}: goodput {100 * s['goodput']:.1f} % of {s['wall_s']:.1f} s "
                f"wall{nodes}: {parts}")
        if s["stragglers"]:
            text += "; " + "; ".join(
                f"straggler rank {x['rank']} ({x['lag_s']:.3g} s behind per step, "
                f"{100 * x['lag_of_step']:.0f} % of a step; slowest phase {x['slowest_phase']})"
                for x in s["stragglers"])
        if s.get("profiles"):   # --profile_steps: where the ranks' traces went
            text += "; " + _profile_opts.describe(s["profiles"])
        return text

    def steps_run(self) -> int:
        """The most training steps a rank ran in the last round (0: none recorded)."""
        return max((d.get("steps_run", 0) for d in self.detail.values()), default=0)

    def say(self) -> None:
        if self.per_rank:
            print(self.line(), file=sys.stderr, flush=True)

    def finish(self, amend=None) -> dict | None:
        """At the job's end: print the line; write LOGDIR/summary.json and the metrics.
        `amend` (summary -> summary) adds what the ranks recorded elsewhere (`_ft.amend`)."""
        if not self.per_rank:
            return None
        s = self.summary() if amend is None else amend(self.summary())
        print(self.line(s), file=sys.stderr, flush=True)
        if self.logdir:
            write(self.logdir, s, self.node, self._writer)
        return s


def merge(own: dict, others: dict) -> dict:
    """Node 0's summary and the other nodes' (node -> summary) as the job's one summary.

    Each node measured its own ranks on its own clock; only durations cross nodes. A rank of a
    node whose launcher started later (or whose last report came earlier) than node 0's gets
    the difference as "other", so every rank's buckets add up to the job's wall time (node
    0's), and the job's buckets are the mean over all ranks. Stragglers are every node's,
    slowest first; "nodes" keeps each node's own wall time, buckets and stragglers.
    """
    wall = own["wall_s"]
    nodes = {"0": own, **{str(k): s for k, s in sorted(others.items())}}
    own = {k: v for k, v in own.items() if k != "arrivals"}
    ranks = {}
    for node, s in nodes.items():
        for rank, detail in s["ranks"].items():
            b = dict(detail["buckets_s"])
            b["other"] = max(0.0, b["other"] + wall - sum(b.values()))
            # an elastic job renumbers ranks: one number may have run on two nodes
            ranks[rank if rank not in ranks else f"{rank}@node{node}"] = {
                **detail, "buckets_s": _rounded(b)}
    n = max(1, len(ranks))
    total = {k: sum(r["buckets_s"][k] for r in ranks.values()) / n for k in BUCKETS}
    stragglers = _job_stragglers(nodes, ranks)
    if stragglers is None:   # some node sent no arrivals: each node's own, slowest first
        stragglers = sorted((x for s in nodes.values() for x in s["stragglers"]),
                            key=lambda x: -x["lag_s"])
    return {**own, "buckets_s": _rounded(total),
            "goodput": round(total["steps"] / wall, 4) if wall > 0 else 0.0,
            "stragglers": stragglers,
            "ranks": dict(sorted(ranks.items(), key=lambda kv: int(kv[0].split("@")[0]))),
            "nodes": {k: {key: s[key] for key in ("wall_s", "buckets_s", "goodput", "rounds",
                                                  "lost_steps", "stragglers") if key in s}
                      for k, s in nodes.items()}}


def _redone(lost_steps: list, last_failed: bool) -> str:
    """The goodput line's words for the steps failed rounds lost: redone only where a restart
    followed (a job whose last round failed did not redo that round's steps)."""
    redone = lost_steps[:-1] if last_failed else lost_steps
    words = []
    if sum(redone):
        words.append(f"{sum(redone)} steps redone after {len(redone)} restart(s)")
    if last_failed and lost_steps and lost_steps[-1]:
        words.append(f"{lost_steps[-1]} steps since the last checkpoint lost in the failed "
                     "last round")
    return f" ({'; '.join(words)})" if words else ""


def _wall_clock_arrivals(times: dict) -> dict:
    """rank -> {step: when it was reached}, on the wall clock (which the nodes share, to NTP's
    precision: milliseconds), not this node's monotonic one."""
    offset = time.time() - time.monotonic()
    return {str(r): {str(k): at + offset for k, at in t.arrivals.items()}
            for r, t in times.items()}


def _job_stragglers(nodes: dict, ranks: dict) -> list | None:
    """The stragglers among every rank of the nodes in the job's last round (node k's
    "last_round", noted by node 0's keeper), from their arrivals; None when one sent none."""
    last = nodes["0"]["rounds"] - 1   # node 0 runs every round
    present = [s for s in nodes.values() if s.get("last_round", last) == last]
    if not all(s.get("arrivals") for s in present):
        return None
    arrivals = {int(r): {int(k): at for k, at in a.items()}
                for s in present for r, a in s["arrivals"].items()}
    found = Stragglers(sorted(arrivals))
    found.feed({r: types.SimpleNamespace(arrivals=a) for r, a in arrivals.items()})
    return found.named({int(r): d.get("phases_s", {}) for r, d in ranks.items() if "@" not in r})


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
