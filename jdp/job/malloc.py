"""Keep glibc from returning XLA:CPU's per-step scratch buffer to the kernel (Linux only).

XLA:CPU allocates one temporary buffer per executable run (36 MiB for the MNIST CNN's step at 64
examples per device). glibc serves blocks above its mmap threshold, which adapts up to 32 MiB
and no further, with a fresh `mmap` and gives them back with `munmap` on free, so every step
faults in and zero-fills ~9 300 new pages: measured 40-50 % of that step on a 2-core machine
(BENCHMARKS.md). `tune()` turns this off with `mallopt`: no mmap for large blocks, no trimming
of the heap's top below 1 GiB, and one arena (XLA's executor threads would otherwise allocate
from per-thread 64 MiB heaps that are unmapped when empty). Freed scratch is then reused by the
next step: the CNN's step runs ~1.7x as fast, with identical results.

It must act before JAX's backend starts (a thread keeps the arena it first allocated from):
`jdp.initialize()` calls `tune()`, and the launcher sets `ENV` in its children, which glibc
reads at process start. `JDP_MALLOC_TUNING=0` turns both off. The cost is that memory freed by
the process stays mapped up to the trim threshold, as with any caching allocator.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
TRIM_THRESHOLD = 1 << 30
_SETTINGS = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_ARENA_MAX, 1))
ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD),
       "MALLOC_ARENA_MAX": "1"}
"""The same settings as environment variables, for a launcher to give its children."""
SWITCH_ENV = "JDP_MALLOC_TUNING"


def enabled(env=os.environ) -> bool:
    """False when the user turned the tuning off (`JDP_MALLOC_TUNING=0`)."""
    return env.get(SWITCH_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def tune() -> bool:
    """Apply the settings to this process; False where off or there is no glibc `mallopt`."""
    if not enabled() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return all([bool(libc.mallopt(param, value)) for param, value in _SETTINGS])
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return False


def child_env(env: dict) -> dict:
    """`env` plus the settings, unless turned off or already chosen by the user."""
    if not enabled(env):
        return env
    return {**ENV, **env}
