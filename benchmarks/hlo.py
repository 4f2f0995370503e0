"""All-reduce traffic of a compiled step, read from its HLO, and what the trees predict.

DDP's cost model is "one all-reduce of the gradient bytes per step". jdp's step averages the
gradients, the floating-point model state (BatchNorm statistics, `model_state_sync="mean"`) and
the metric scalars; XLA's all-reduce combiner merges them into one tuple all-reduce. Counting
ops and bytes in `step.lower(state, batch).compile().as_text()` checks that nothing else is
communicated and nothing is sent twice.
"""
from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import numpy as np

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8,
                "c128": 16}
# `%name = <result shape> all-reduce(` or the async `all-reduce-start(`; `-done` is not counted.
_OP = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.+?)\s+(all-reduce(?:-start)?)\(")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


class AllReduces(NamedTuple):
    """All-reduce ops of one compiled step: how many, bytes sent per device, and arrays."""
    ops: int
    bytes: int
    arrays: int


def _shape_bytes(shape_text: str) -> tuple[int, int]:
    """Total bytes and number of arrays in an HLO result shape (array or tuple)."""
    total = count = 0
    for dtype, dims in _SHAPE.findall(shape_text):
        if dtype not in _DTYPE_BYTES:
            continue
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += size * _DTYPE_BYTES[dtype]
        count += 1
    return total, count


def all_reduces(hlo_text: str) -> AllReduces:
    """Count the all-reduce ops of an optimised HLO module and the bytes of their results."""
    ops = total = arrays = 0
    for line in hlo_text.splitlines():
        match = _OP.match(line)
        if match:
            nbytes, count = _shape_bytes(match.group(1))
            ops, total, arrays = ops + 1, total + nbytes, arrays + count
    return AllReduces(ops, total, arrays)


def tree_bytes(tree: Any, floating_only: bool = False) -> int:
    """Bytes of one copy of a pytree's leaves (optionally only floating-point leaves)."""
    leaves = [x for x in jax.tree.leaves(tree)
              if not floating_only or np.issubdtype(np.asarray(x).dtype, np.floating)]
    return int(sum(np.asarray(x).size * np.asarray(x).dtype.itemsize for x in leaves))


def expected_bytes(params: Any, model_state: Any = None, metric_scalars: int = 0) -> int:
    """What jdp's step should all-reduce: the gradient (= parameter bytes), the floating
    model state when it is synchronised, and one float32 per metric."""
    synced = tree_bytes(model_state, floating_only=True) if model_state is not None else 0
    return tree_bytes(params) + synced + 4 * metric_scalars
