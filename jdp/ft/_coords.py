"""Where this process stands among the replica groups: read from the environment once.

`jdp.launch --replica_group G --replica_groups R --ft_lighthouse ...` sets the variables;
under another engine (srun, mpirun, a JobSet per group) the job sets them itself.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from jdp.job import env as _env
from jdp.job import values

GROUP, GROUPS = _env.REPLICA_GROUP, _env.REPLICA_GROUPS
LIGHTHOUSE, EVENTS = _env.FT_LIGHTHOUSE, _env.FT_EVENTS
_HOW = ("start each group with jdp.launch --replica_group G --replica_groups R --ft_lighthouse "
        f"start|HOST:PORT, or set {GROUP}, {GROUPS} and {LIGHTHOUSE} under another engine")


class Coordinates(NamedTuple):
    """This replica group's index among `groups`, the Lighthouse's address, and the file the
    group's process 0 appends its events to (None: none kept)."""
    group: int
    groups: int
    lighthouse: str
    events: str | None = None


def coordinates(group: int | None = None, groups: int | None = None,
                lighthouse: str | None = None, who: str = "jdp.ft.Replicas") -> Coordinates:
    """The arguments given, else the environment's; a one-line ValueError names what is
    missing or out of range."""
    group, groups = group_of(group, groups, who)
    lighthouse = lighthouse or os.environ.get(LIGHTHOUSE, "")
    if not lighthouse:
        raise ValueError(f"{who}: no Lighthouse address ({LIGHTHOUSE} is not set); {_HOW}")
    if "://" not in lighthouse:
        lighthouse = "http://" + lighthouse
    return Coordinates(group, groups, lighthouse, os.environ.get(EVENTS) or None)


def group_of(group: int | None, groups: int | None, who: str) -> tuple[int, int]:
    """`(group, groups)`: the arguments given, else the environment's, checked."""
    group = _integer(group, "group", GROUP, who)
    groups = _integer(groups, "groups", GROUPS, who)
    if groups < 1 or not 0 <= group < groups:
        raise ValueError(f"{who}: replica group {group} of {groups} is out of range; pass "
                         "0 <= group < groups (groups >= 1)")
    return group, groups


def _integer(value: int | None, argument: str, name: str, who: str) -> int:
    """The argument (an int, NumPy's too), else the variable `name`'s integer."""
    if value is not None:
        return values.integer(who, argument, value, minimum=0 if argument == "group" else 1,
                              fix="or leave it out to read " + name)
    text = os.environ.get(name)
    if text is None:
        raise ValueError(f"{who}: {name} is not set; {_HOW}")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{who}: {name}={text!r} is not an integer; {_HOW}") from None
