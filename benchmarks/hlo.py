"""Collective traffic of a compiled step, read from its HLO text.

DDP's cost model is "one all-reduce of the gradient bytes per step"; counting the ops and bytes
in `step.lower(...).compile().as_text()` checks that nothing else is sent and nothing twice.
"""
from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import numpy as np

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# `%name = <result shape> all-reduce(`, or the async `all-reduce-start(` (not `-done`).
_OP = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.+?)\s+(all-reduce|reduce-scatter|all-gather)"
                 r"(?:-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


class Collective(NamedTuple):
    """Ops of one kind in a compiled step: how many, bytes of their results, arrays."""
    ops: int = 0
    bytes: int = 0
    arrays: int = 0


def collectives(hlo_text: str) -> dict[str, Collective]:
    """A `Collective` per kind (all-reduce, reduce-scatter, all-gather) of an HLO module."""
    found = dict.fromkeys(("all-reduce", "reduce-scatter", "all-gather"), Collective())
    for line in hlo_text.splitlines():
        if match := _OP.match(line):
            shapes = [(t, d) for t, d in _SHAPE.findall(match.group(1)) if t in _BYTES]
            size = sum(int(np.prod([int(x) for x in d.split(",") if x])) * _BYTES[t]
                       for t, d in shapes)
            c = found[match.group(2)]
            found[match.group(2)] = Collective(c.ops + 1, c.bytes + size, c.arrays + len(shapes))
    return found


def ring_bytes(found: dict[str, Collective], n: int) -> float:
    """Bytes each of `n` devices sends per step under ring algorithms: an all-reduce of S sends
    2(n-1)/n S, a reduce-scatter to S/n and an all-gather to S send (n-1)/n S each."""
    return (n - 1) / n * (2 * found["all-reduce"].bytes + n * found["reduce-scatter"].bytes
                          + found["all-gather"].bytes)


def expected_bytes(params: Any, model_state: Any, metric_scalars: int) -> int:
    """What a DDP step all-reduces: the gradient (= parameter bytes), the floating model state
    (BatchNorm statistics) and one float32 per metric."""
    leaves = [np.asarray(x) for x in jax.tree.leaves((params, model_state))]
    return sum(x.nbytes for x in leaves if np.issubdtype(x.dtype, np.floating)) + 4 * metric_scalars
