"""Where a step's time goes: XLA CPU op times from a `jax.profiler` trace, by kind of work.

The trace records one event per executed HLO op on the thread that ran it. Each op is classed
by what its HLO computes (op metadata is no guide: XLA:CPU fuses e.g. a convolution's backward
pass into a fusion named after a forward `reduce_sum`). Page faults land inside the ops that
first touch fresh pages; `harness.timed` counts them separately.
"""
from __future__ import annotations

import collections
import glob
import re
import tempfile
from collections.abc import Callable

import jax

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*\S.*?\s([a-z][a-z0-9-]*)\(")
_CALLS = re.compile(r"calls=%([\w.-]+)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.-]+)\s.*\{\s*$")
_MARKS = (("all-reduce", (" all-reduce(", " all-reduce-start(")),
          ("convolution", (" convolution(",)), ("matmul", (" dot(",)),
          ("pooling (reduce-window, scatter)",
           (" reduce-window(", " select-and-scatter(", " scatter(")),
          ("reduction", (" reduce(",)),
          ("copy", (" copy(", " transpose(")))
KINDS = (*(kind for kind, _ in _MARKS), "elementwise")


def op_kinds(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> one of `KINDS`, from its opcode and (for a fusion) its body."""
    bodies, name, lines = {}, None, []
    for line in hlo_text.splitlines():
        match = _COMPUTATION.match(line)
        if match:
            name, lines = match.group(1), []
        elif line.startswith("}") and name:
            bodies[name], name = "\n".join(lines), None
        elif name:
            lines.append(line)
    kinds = {}
    for line in hlo_text.splitlines():
        match = _INSTR.match(line)
        if match:
            called = _CALLS.search(line)
            text = f" {match.group(2)}( {bodies.get(called.group(1), '') if called else ''}"
            kinds[match.group(1)] = next((kind for kind, marks in _MARKS
                                          if any(m in text for m in marks)), "elementwise")
    return kinds


def breakdown(run_steps: Callable[[int], None], hlo_text: str, steps: int) -> dict[str, float]:
    """CPU milliseconds per step by kind of op (summed over devices and threads), plus
    "all-reduce wait" (devices waiting for each other), from tracing `run_steps(steps)`."""
    kinds = op_kinds(hlo_text)
    rows = collections.Counter({k: 0.0 for k in KINDS})
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            run_steps(steps)
        path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
        for plane in jax.profiler.ProfileData.from_file(path).planes:
            for line in plane.lines:
                if line.name.startswith("python"):
                    continue
                for event in line.events:  # executed HLO ops; the rest is runtime bookkeeping
                    kind = kinds.get(event.name, "all-reduce wait"
                                     if event.name == "Rendezvous" else None)
                    if kind:
                        rows[kind] += event.duration_ns / 1e6 / steps
    return dict(rows)
