"""Where a step's time goes: XLA:CPU op times from a `jax.profiler` trace, by kind of work.

The trace has one event per executed HLO op. Each op is classed by what its HLO computes, a
fusion by its body (op metadata is no guide: XLA:CPU names e.g. a convolution's backward pass
after a forward `reduce_sum`). Page faults land inside the ops that first touch fresh pages.
"""
from __future__ import annotations

import collections
import glob
import re
import tempfile

import jax

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.-]+) [^\n]*\{\n(.*?)^\}", re.M | re.S)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*\S.*?\s([a-z][a-z0-9-]*)\(.*$", re.M)
_CALLS = re.compile(r"calls=%([\w.-]+)")
_MARKS = {"all-reduce": ("all-reduce", "all-reduce-start"), "convolution": ("convolution",),
          "matmul": ("dot",), "pooling (reduce-window, scatter)":
          ("reduce-window", "select-and-scatter", "scatter"), "reduction": ("reduce",),
          "copy": ("copy", "transpose")}
KINDS = (*_MARKS, "elementwise")


def op_kinds(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> one of `KINDS`, from its opcode and (for a fusion) its body."""
    bodies = {m.group(1): m.group(2) for m in _COMPUTATION.finditer(hlo_text)}
    kinds = {}
    for m in _INSTR.finditer(hlo_text):
        called = _CALLS.search(m.group(0))
        text = f" {m.group(2)}( {bodies.get(called.group(1), '') if called else ''}"
        kinds[m.group(1)] = next((kind for kind, ops in _MARKS.items()
                                  if any(f" {op}(" in text for op in ops)), "elementwise")
    return kinds


def breakdown(run_steps, hlo_text: str, steps: int) -> dict[str, float]:
    """CPU milliseconds per step by kind of op (summed over devices and threads), and
    "all-reduce wait" (devices waiting for each other), from tracing `run_steps(steps)`."""
    kinds, rows = op_kinds(hlo_text), collections.Counter(dict.fromkeys(KINDS, 0.0))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            run_steps(steps)
        path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
        for plane in jax.profiler.ProfileData.from_file(path).planes:
            for line in plane.lines:
                for event in [] if line.name.startswith("python") else line.events:
                    kind = kinds.get(event.name, "all-reduce wait"
                                     if event.name == "Rendezvous" else None)
                    if kind:  # an executed HLO op; the rest is runtime bookkeeping
                        rows[kind] += event.duration_ns / 1e6 / steps
    return dict(rows)
