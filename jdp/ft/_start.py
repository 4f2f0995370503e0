"""When a group at step 0 may train: the job's first step, or a group that finds nobody ahead.

Every group of a quorum decides from the same rows (`_agreement.exchange`: each group's index,
its torchft step, the steps its own record shows, whether it has waited `start_timeout`), so
they all decide alike:

- a group ahead of this one (step > 0) is a live peer: wait for the next quorum, which heals;
- a record that shows commits while every group here is at step 0 means the job had gone on
  and nobody here holds its state: stop, rather than train from the initial state; at once
  when every group is here or this group is alone (nobody else heartbeats to the
  Lighthouse, or it would not have formed a quorum of one), else after `quorum_timeout` (a
  live group in a long step joins within it);
- a fresh job starts when all its groups are here, or, with `min_groups` below the groups,
  with at least `min_groups` once a group has waited `start_timeout`; otherwise a group that
  waited `start_timeout` stops: never a silent start alone.

Pure functions of the rows; `Replicas` acts on the verdicts.
"""
from __future__ import annotations

from typing import NamedTuple

GO, WAIT = "go", "wait"


class Me(NamedTuple):
    """This group, and the limits it was given."""
    group: int
    groups: int
    min_groups: int
    start_timeout: float
    quorum_timeout: float
    past: int            # steps this group's record shows it committed (0: a first start)


def decide(rows: list, me: Me, waited: float) -> str:
    """GO, WAIT, or the one line to stop with, for the rows of one quorum at step 0."""
    if any(r["step"] > 0 for r in rows):
        return WAIT
    if max(r["past"] for r in rows) > 0:
        alone_or_all = len(rows) == 1 or len(rows) >= me.groups
        return no_peer(rows, me) if alone_or_all or waited > me.quorum_timeout else WAIT
    if len(rows) >= me.groups:
        return GO
    if len(rows) >= me.min_groups:   # enough: every group starts once one row says it has
        return GO if any(r["ready"] for r in rows) else WAIT   # waited (the same rows
    return too_few(rows, me) if waited > me.start_timeout else WAIT   # everywhere)


def ready(me: Me, waited: float) -> bool:
    """This group's flag in its row: it has waited `start_timeout` (with `min_groups` below
    the groups, a flag that starts every group of the quorum)."""
    return waited >= me.start_timeout


def no_peer(rows: list, me: Me) -> str:
    """The line of a group that finds the job gone on and nobody to heal from."""
    best = max(rows, key=lambda r: (r["past"], r["group"] == me.group))
    who = "this group" if best["group"] == me.group else f"replica group {best['group']}"
    return (f"jdp.ft: no live replica group to heal from: {who} had committed {best['past']} "
            f"steps, and the groups here ({_groups(rows)}) are all at step 0; the others are "
            "gone or finished; restart the job from a checkpoint")


def too_few(rows: list, me: Me) -> str:
    """The line of a fresh group that waited `start_timeout` for too few groups."""
    fewer = ("pass jdp.ft.Replicas(min_groups=K) to start with K or more" if me.min_groups
             == me.groups else f"min_groups={me.min_groups} is not reached")
    return (f"jdp.ft: replica group {me.group} waited start_timeout={me.start_timeout:g} s for "
            f"the job's {me.groups} replica groups and found {len(rows)} ({_groups(rows)}); a "
            f"fresh job starts with all of them: start the others (the same Lighthouse and "
            f"--replica_groups {me.groups}), or {fewer}; if the others already finished, the "
            "job is over")


def waiting(rows: list, me: Me) -> str:
    """The notice of a group that has waited a while at step 0."""
    if me.past > 0 or max(r["past"] for r in rows) > 0:
        return (f"jdp.ft: group {me.group} (its record: {me.past} steps committed) finds no live "
                f"replica group ahead of it: {len(rows)} of {me.groups} here ({_groups(rows)}), "
                f"all at step 0; it waits up to quorum_timeout={me.quorum_timeout:g} s for one "
                "to heal from, then stops")
    fewer = ("" if me.min_groups == me.groups else
             f", or starts with {me.min_groups} or more after it")
    return (f"jdp.ft: group {me.group} waits for the other replica groups to join the job's "
            f"first step: {len(rows)} of {me.groups} so far ({_groups(rows)}); it stops after "
            f"start_timeout={me.start_timeout:g} s{fewer}")


def fewer(rows: list, me: Me) -> str:
    """The line of a fresh job that starts with fewer than all its groups."""
    return (f"jdp.ft: group {me.group} starts the job with {len(rows)} of {me.groups} replica "
            f"groups ({_groups(rows)}) after start_timeout={me.start_timeout:g} s "
            f"(min_groups={me.min_groups}); the others heal from them when they join")


def _groups(rows: list) -> str:
    return "groups " + ", ".join(str(g) for g in sorted(r["group"] for r in rows))
