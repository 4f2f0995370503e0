"""What a replica group's job saw of fault tolerance: its events file, as the `"ft"` section
of the summary and one printed line.

With `--replica_groups`, the group's process 0 appends one JSON object per line to the file
named by `JDP_FT_EVENTS` (the launcher's working directory; appended across restarts):

- `{"event": "join", "group": G, "restart": n, "time": t}`: a process of the group joined;
- `{"event": "connect", "time": t}`: the group, its step compiled, made itself known to the
  Lighthouse (its first quorum follows);
- `{"event": "commit", "step": s, "groups": [...], "seconds": d, "time": t}`: step s (the
  state's step after it) committed with those groups, in an attempt of d seconds;
- `{"event": "discard", "step": s, "groups": [...], "seconds": d, "time": t, "error": ...}`:
  an attempt at step s discarded (no update): its d seconds are lost work;
- `{"event": "heal", "step": s, "seconds": d, "time": t}`: the group healed from a live peer;
- `{"event": "start", "groups": [...], "source": g, "time": t}`: an attempt at a fresh job's
  first step began from group g's state;
- `{"event": "stop", "step": s, "reason": line, "time": t}`: the group stopped for good (the
  groups differ, no live group to heal from, too few groups); its restarts stop at once.

The functions below are pure over the list of events, so a run's record can be read back
and replayed: `quorums` says which groups made each committed step.
"""
from __future__ import annotations

import statistics

from jdp.job import events as _events

SHOWN = 3   # heals and stalls listed one by one in the printed line; the rest counted
_FIELDS = {"join": ("time",), "commit": ("step", "groups", "seconds", "time"),
           "discard": ("step", "groups", "seconds", "time"), "heal": ("step", "seconds", "time")}


def read_events(path: str | None) -> list:
    """The events in the JSON-lines file at `path` ([] when it is absent). A line that is not
    an event with its fields is skipped: a process killed mid-write leaves a truncated one."""
    return [e for e in _events.read(path)
            if all(k in e for k in _FIELDS.get(e.get("event"), ("?",)))]


def _of(events: list, kind: str) -> list:
    return [e for e in events if e.get("event") == kind]


def quorums(commits: list) -> list:
    """The run-length form of the committed steps' group sets: [[first_step, last_step,
    [groups]], ...]; a run ends where the set changes or the steps are not consecutive (a
    group restarted from an older step)."""
    runs: list = []
    for e in commits:
        groups = sorted(e["groups"])
        if runs and runs[-1][2] == groups and e["step"] == runs[-1][1] + 1:
            runs[-1][1] = e["step"]
        else:
            runs.append([e["step"], e["step"], groups])
    return runs


def failures(events: list) -> list:
    """One entry per discarded attempt, and per drop in the group set (a commit without a
    group of the commit before it) that no discard since that commit explains already (a
    kill in a step is one discard, then the redone step with fewer groups: one failure).

    Each is {"step", "stall_s", "groups_after"}: the stall is what the failure cost this
    group, the time from the last commit before it (or the start of the discarded attempt
    when none came before) to the next commit, less one ordinary step (the median of the
    commits' seconds; the next commit's own seconds contain the wait, so they are no measure
    of a step); None (and groups_after []) when no commit came after it. A gap in which this
    group itself restarted (a "join" with restart > 0) is its downtime (`downtimes`), not a
    stall."""
    typical = _typical_step(events)
    found, last, pending, previous = [], None, [], None
    for e in events:
        if e.get("event") == "discard":
            pending.append(e)
        elif e.get("event") == "join" and e.get("restart", 0) > 0:
            pending, last, previous = [], None, None   # its own restart: downtime
        elif e.get("event") == "commit":
            dropped = previous is not None and not previous <= set(e["groups"])
            for cause in pending or ([e] if dropped else []):
                found.append(_failure(cause, last, e, typical))
            pending, last, previous = [], e, set(e["groups"])
    return found + [_failure(cause, last, None, typical) for cause in pending]


def downtimes(events: list) -> list:
    """This group's own restarts: [{"step", "downtime_s"}], the time from its last commit (or
    event) before the restart to its first commit after it, heal included."""
    found, last, down = [], None, None
    for e in events:
        if e.get("event") == "join" and e.get("restart", 0) > 0:
            down = last if last is not None else e
        elif e.get("event") == "commit":
            if down is not None:
                found.append({"step": e["step"], "downtime_s": round(e["time"] - down["time"], 3)})
                down = None
            last = e
    return found


def _typical_step(events: list) -> float:
    seconds = [e["seconds"] for e in events if e.get("event") == "commit"]
    return statistics.median(seconds) if seconds else 0.0


def _failure(cause: dict, before: dict | None, after: dict | None, typical: float) -> dict:
    start = before["time"] if before else cause["time"] - cause["seconds"]
    stall = None if after is None else round(max(0.0, after["time"] - start - typical), 3)
    return {"step": cause["step"], "stall_s": stall,
            "groups_after": sorted(after["groups"]) if after else []}


def section(events: list, group: int, groups: int) -> dict | None:
    """The summary's `"ft"` section of this group's events (None when there are none).

    Args:
        events: as `read_events` returns them, in the order written.
        group: this launcher's --replica_group.
        groups: the job's --replica_groups.
    """
    if not events:
        return None
    commits, discards = _of(events, "commit"), _of(events, "discard")
    return {"group": group, "groups": groups, "committed": len(commits),
            "discarded": len(discards),
            "discarded_s": round(sum((e["seconds"] for e in discards), 0.0), 3),
            "fewer_groups_steps": sum(len(set(e["groups"])) < groups for e in commits),
            "quorums": quorums(commits), "failures": failures(events),
            "downtimes": downtimes(events),
            "heals": [{"step": e["step"], "seconds": e["seconds"]} for e in _of(events, "heal")]}


def amend(summary: dict, ft: dict | None) -> dict:
    """The goodput summary with the `"ft"` section added and the discarded attempts' seconds
    moved from "steps" to "lost" (every rank of the group ran them), its goodput anew. A group
    that healed after a restart redid no step (it took the live peers' state): its failed
    rounds' `lost_steps` are 0."""
    if ft is None:
        return summary

    def moved(buckets: dict) -> dict:
        lost = min(ft["discarded_s"], buckets["steps"])
        return {**buckets, "steps": round(buckets["steps"] - lost, 4),
                "lost": round(buckets["lost"] + lost, 4)}

    buckets = moved(summary["buckets_s"])
    ranks = {r: {**d, "buckets_s": moved(d["buckets_s"])}
             for r, d in summary.get("ranks", {}).items()}
    wall = summary["wall_s"]
    lost_steps = summary.get("lost_steps", [])
    if ft["heals"]:
        lost_steps = [0] * len(lost_steps)
    return {**summary, "buckets_s": buckets, "ranks": ranks, "ft": ft, "lost_steps": lost_steps,
            "goodput": round(buckets["steps"] / wall, 4) if wall > 0 else 0.0}


def line(who: str, ft: dict) -> str:
    """'jdp.launch: ft group 1 of 3: 200 steps committed (37 with fewer groups), 2 discarded,
    1 heal (0.4 s at step 81), stalls 1.1 s'."""
    heals = ft["heals"]
    text = (f"{who}: ft group {ft['group']} of {ft['groups']}: {ft['committed']} "
            f"step{'' if ft['committed'] == 1 else 's'} committed ({ft['fewer_groups_steps']} "
            f"with fewer groups), {ft['discarded']} discarded, "
            f"{len(heals)} heal{'' if len(heals) == 1 else 's'}")
    if heals:
        text += " (" + _listed([f"{h['seconds']:.1f} s at step {h['step']}" for h in heals]) + ")"
    down = ft.get("downtimes", [])
    if down:
        text += (f", down {sum(d['downtime_s'] for d in down):.1f} s in {len(down)} "
                 f"restart{'' if len(down) == 1 else 's'}")
    return text + ", " + _stalls(ft["failures"])


def _stalls(found: list) -> str:
    """'stalls 1.1 s' (one failure), 'stalls 1.5 s (1.1 s, 0.4 s)' (their total, then each);
    a failure with no commit after it is named by its step."""
    if not found:
        return "no stalls"
    total = sum(f["stall_s"] or 0.0 for f in found)
    each = [f"{f['stall_s']:.1f} s" if f["stall_s"] is not None
            else f"none after step {f['step']} (no later commit)" for f in found]
    return f"stalls {total:.1f} s" + (f" ({_listed(each)})" if len(found) > 1 or
                                      found[0]["stall_s"] is None else "")


def _listed(items: list) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown if len(items) <= SHOWN else f"{shown} and {len(items) - SHOWN} more"
