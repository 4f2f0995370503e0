"""Collective traffic of a compiled step, read from its HLO, and what the trees predict.

DDP's cost model is "one all-reduce of the gradient bytes per step"; jdp also averages the
floating model state (BatchNorm statistics) and the metrics, which XLA's combiner merges into
the same all-reduce. Counting ops and bytes in `step.lower(...).compile().as_text()` checks that
nothing else is communicated and nothing twice.
"""
from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import numpy as np

KINDS = ("all-reduce", "reduce-scatter", "all-gather")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# `%name = <result shape> all-reduce(` or the async `all-reduce-start(`; `-done` is not counted.
_OP = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.+?)\s+(all-reduce|reduce-scatter|all-gather)"
                 r"(?:-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


class Collective(NamedTuple):
    """Ops of one kind in a compiled step: how many, bytes of their results, arrays."""
    ops: int = 0
    bytes: int = 0
    arrays: int = 0


def _shape_bytes(shape_text: str) -> tuple[int, int]:
    """Total bytes and number of arrays in an HLO result shape (array or tuple)."""
    total = count = 0
    for dtype, dims in _SHAPE.findall(shape_text):
        if dtype in _DTYPE_BYTES:
            total += int(np.prod([int(d) for d in dims.split(",") if d])) * _DTYPE_BYTES[dtype]
            count += 1
    return total, count


def collectives(hlo_text: str) -> dict[str, Collective]:
    """`Collective` per kind in `KINDS` of an optimised HLO module."""
    found = {kind: Collective() for kind in KINDS}
    for line in hlo_text.splitlines():
        match = _OP.match(line)
        if match:
            nbytes, count = _shape_bytes(match.group(1))
            c = found[match.group(2)]
            found[match.group(2)] = Collective(c.ops + 1, c.bytes + nbytes, c.arrays + count)
    return found


def ring_bytes(found: dict[str, Collective], n: int) -> float:
    """Bytes each of `n` devices sends per step under ring algorithms: an all-reduce of S sends
    2(n-1)/n S, a reduce-scatter to S/n and an all-gather to S send (n-1)/n S each."""
    return (n - 1) / n * (2 * found["all-reduce"].bytes + n * found["reduce-scatter"].bytes
                          + found["all-gather"].bytes)


def tree_bytes(tree: Any, floating_only: bool = False) -> int:
    """Bytes of one copy of a pytree's leaves (optionally only floating-point leaves)."""
    leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
    return int(sum(x.nbytes for x in leaves
                   if not floating_only or np.issubdtype(x.dtype, np.floating)))


def expected_bytes(params: Any, model_state: Any = None, metric_scalars: int = 0) -> int:
    """What jdp's step should all-reduce: the gradient (= parameter bytes), the floating
    model state, and one float32 per metric."""
    return tree_bytes(params) + tree_bytes(model_state, True) + 4 * metric_scalars
