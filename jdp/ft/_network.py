"""A slower network between replica groups, emulated, for benchmarks and tests.

`JDP_FT_NETWORK="GBIT,LATENCY"` (e.g. "1,0.01": 1 Gbit/s and 10 ms) holds each cross-group
all-reduce's result until a ring all-reduce of its bytes would have finished on such a link:
LATENCY + 2 (n - 1) / n x bytes x 8 / GBIT x 1e9 seconds after it began, for n groups; and
each quorum until LATENCY after it was asked for (its round trip to a Lighthouse as far away).
A result read later waits only for what is left, so work overlapped with it hides it as it
would hide a real transfer. Unset: no delay.
"""
from __future__ import annotations

import os
import time

ENV = "JDP_FT_NETWORK"


def link() -> tuple[float, float] | None:
    """(bits per second, latency in seconds) from `JDP_FT_NETWORK`, or None."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        gbit, latency = (float(x) for x in text.split(","))
    except ValueError:
        gbit = latency = -1.0
    if not (gbit > 0 and latency >= 0):
        raise ValueError(f"{ENV}={text!r}: give GBIT,LATENCY (e.g. '1,0.01': 1 Gbit/s, 10 ms)")
    return gbit * 1e9, latency


def ready_at(link: tuple[float, float] | None, began: float, nbytes: int,
             groups: int) -> float:
    """When an all-reduce of `nbytes` over `groups` groups begun at `began`
    (`time.perf_counter()`) would end on `link` (`began` when None)."""
    if link is None or groups < 2:
        return began
    bits, latency = link
    return began + latency + 2 * (groups - 1) / groups * nbytes * 8 / bits


def quorum_at(link: tuple[float, float] | None, began: float) -> float:
    """When a quorum asked for at `began` would be answered on `link` (`began` when None)."""
    return began if link is None else began + link[1]


def hold(until: float) -> None:
    """Sleep until `until` (`time.perf_counter()`), if it is still ahead."""
    left = until - time.perf_counter()
    if left > 0:
        time.sleep(left)
