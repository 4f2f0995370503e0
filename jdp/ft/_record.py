"""What a restarted replica group remembers of the job: its own events file.

The group's launcher keeps `JDP_FT_EVENTS` for its whole life and the group's process 0
appends to it across the group's restarts (`jdp.job.events`). After a restart
(`JDP_RESTART_COUNT` > 0) the file says how far this group had got, so a group that finds no
live peer to heal from knows the job had gone on (and stops rather than start over), and
whether it had stopped for good (a difference between groups, no live peer): then every
restart stops at once with the same line, instead of meeting the others again.
"""
from __future__ import annotations

from typing import NamedTuple

from jdp.job import events as _events

STOP = "stop"   # the event of a group that stopped for good: {"event": "stop", "reason": line}


class Past(NamedTuple):
    """This group's record since its job began."""
    steps: int                  # the last step it committed (or healed to); 0: none
    stopped: str | None = None  # the line it stopped with, if it stopped for good


def past(path: str | None, restart: int) -> Past:
    """The record in the events file at `path` since the job's first start (the last "join"
    of restart 0); nothing for a first start (`restart` 0) or without a file."""
    if not path or restart == 0:
        return Past(0)
    events = _events.read(path)
    begun = max((i for i, e in enumerate(events)
                 if e.get("event") == "join" and e.get("restart") == 0), default=0)
    since = events[begun:]
    steps = max((int(e["step"]) for e in since
                 if e.get("event") in ("commit", "heal") and isinstance(e.get("step"), int)),
                default=0)
    stops = [e.get("reason") for e in since if e.get("event") == STOP and e.get("reason")]
    return Past(steps, stops[-1] if stops else None)
