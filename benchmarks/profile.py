"""Where a step's time goes: XLA CPU op times from a `jax.profiler` trace, by kind of work.

The trace records one event per executed HLO op (a fusion, a convolution, the all-reduce) on
the thread that ran it. Each op is classed by what its HLO computes: a (fused) convolution, a
matrix multiply, the all-reduce, a fusion that reduces (BatchNorm statistics, max-pooling, the
loss), a layout copy, or elementwise work. Op metadata is no guide here: XLA:CPU fuses e.g. a
convolution's backward pass into a fusion named after a forward `reduce_sum`.

Page faults show up inside the ops that first touch fresh pages (mostly elementwise fusions
and convolutions writing their outputs); `benchmarks.worker` counts them separately (minor
faults and system CPU time per step, from `getrusage`).

This reads the trace through `jax._src.lib._profile_data`, a private module; if it is missing
the suite reports the profile as unavailable.
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
KINDS = ("convolution", "matmul", "all-reduce", "reduction", "copy", "elementwise")


def _computations(hlo_text: str) -> dict[str, str]:
    """Computation name -> its body text."""
    bodies, name, lines = {}, None, []
    for line in hlo_text.splitlines():
        match = _COMPUTATION.match(line)
        if match:
            name, lines = match.group(1), []
        elif line.startswith("}") and name:
            bodies[name], name = "\n".join(lines), None
        elif name:
            lines.append(line)
    return bodies


def _kind(opcode: str, body: str) -> str:
    """What an op computes, from its opcode and (for a fusion) its fused body."""
    text = f" {opcode}( {body}"
    for kind, marks in (("all-reduce", (" all-reduce(", " all-reduce-start(")),
                        ("convolution", (" convolution(",)), ("matmul", (" dot(",)),
                        ("reduction", (" reduce(", " reduce-window(", " scatter(")),
                        ("copy", (" copy(", " transpose("))):
        if any(mark in text for mark in marks):
            return kind
    return "elementwise"


def op_kinds(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> one of `KINDS`, for every instruction of the module."""
    bodies = _computations(hlo_text)
    kinds = {}
    for line in hlo_text.splitlines():
        match = _INSTR.match(line)
        if match:
            called = _CALLS.search(line)
            body = bodies.get(called.group(1), "") if called else ""
            kinds[match.group(1)] = _kind(match.group(2), body)
    return kinds


def _event_times(trace_dir: str) -> collections.Counter:
    """Total nanoseconds per event name over all non-Python threads of a trace."""
    from jax._src.lib import _profile_data

    path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
    totals: collections.Counter = collections.Counter()
    for plane in _profile_data.ProfileData.from_file(path).planes:
        for line in plane.lines:
            if not line.name.startswith("python"):
                for event in line.events:
                    totals[event.name] += event.duration_ns
    return totals


def breakdown(run_steps: Callable[[int], None], hlo_text: str, steps: int) -> dict[str, float]:
    """CPU milliseconds per step by kind of op (summed over devices and threads), plus
    "all-reduce wait" (devices waiting for each other), from tracing `run_steps(steps)`."""
    kinds = op_kinds(hlo_text)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            run_steps(steps)
        totals = _event_times(trace_dir)
    rows: collections.Counter = collections.Counter({k: 0.0 for k in KINDS})
    for event, ns in totals.items():
        if event in kinds:  # an executed HLO op; the rest are runtime bookkeeping spans
            rows[kinds[event]] += ns / 1e6 / steps
        elif event == "Rendezvous":
            rows["all-reduce wait"] += ns / 1e6 / steps
    return dict(rows)
