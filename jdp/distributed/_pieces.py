"""Global arrays assembled from per-process pieces agree across processes on shape and dtype.

`jdp.shard` and the Loader make each process's rows its part of one global array; JAX infers
the global shape from the local piece (local rows x processes) and never compares it with the
other processes'. Pieces that differ (one process with more rows, or another dtype) give each
process its own idea of the batch, and the next collective hangs or mixes values. So each new
signature (leaf names, dtypes, shapes) is agreed once through `_group.agree`, which names the
first difference and the processes on each side, on every process, in seconds; a signature
agreed before costs one set lookup.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jdp.distributed import _group


def signature(tree: Any) -> list[tuple[str, str]]:
    """(leaf name, "dtype[shape]") of every leaf of `tree`, as the processes compare them."""
    return [(jax.tree_util.keystr(path) or "<root>", f"{np.dtype(x.dtype)}{list(np.shape(x))}")
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def agree_once(seen: set, topic: str, tree: Any, who: str, fix: str,
               timeout_s: float = _group.AGREE_TIMEOUT_S) -> None:
    """Raise on every process unless all hold `tree` with the same signature; a signature in
    `seen` (agreed before by this caller) is not asked again."""
    if jax.process_count() == 1:
        return
    facts = signature(tree)
    key = repr(facts)
    if key in seen:
        return
    _group.agree(topic, facts, who, fix, timeout_s)
    seen.add(key)
