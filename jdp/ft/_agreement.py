"""What the groups of one quorum tell each other before they train together, over torchft.

`exchange`: one fixed-size all-reduce at the first attempt of every new quorum (and at every
poll of a job's first step): a `[participants, ROW_BYTES]` uint8 matrix in which each group
writes its row (its index, its fingerprint, its record) at its own rank in the quorum, zeros
elsewhere. The sum is every group's row, byte for byte, on every group: so every group
compares the same rows and reaches the same verdict. The matrix's size depends only on the
quorum, which all its groups share, never on what the groups were started with.

`initial_state`: a fresh job's first step gives every group the state of one of them, the
same way: the source writes its state's bytes, the others zeros, and the sum is the source's
bytes on every group, bitwise.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

ROW_BYTES = 4096   # one group's row: JSON of its index, fingerprint, record (about 1 KB)


def encode(row: dict) -> bytes:
    """`row` as compact JSON bytes that fit ROW_BYTES (the fingerprint's texts cut when a
    state's texts are unusually long)."""
    data = json.dumps(row, separators=(",", ":"), sort_keys=True).encode()
    if len(data) > ROW_BYTES:
        fp = {k: (v[:40] if isinstance(v, str) else v) for k, v in row.get("fp", {}).items()}
        data = json.dumps({**row, "fp": fp}, separators=(",", ":"), sort_keys=True).encode()
    if len(data) > ROW_BYTES:
        raise ValueError(f"jdp.ft: this group's fingerprint takes {len(data)} bytes, more than "
                         f"{ROW_BYTES}")
    return data


def decode(raw: np.ndarray) -> dict | None:
    """A row back from its bytes; None for an empty or unreadable row."""
    data = raw.tobytes().rstrip(b"\0")
    try:
        row = json.loads(data) if data else None
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def exchange(manager: Any, pg: Any, row: dict) -> list | None:
    """Every group's row in this quorum, in the quorum's rank order, the same list on every
    group; None when the all-reduce failed (a group died: this process then closes its links
    so the others fail at once too, and the attempt is discarded as usual)."""
    n, rank = manager.num_participants(), manager.participating_rank()
    if rank is None or n < 1:
        return None
    matrix = np.zeros((n, ROW_BYTES), np.uint8)
    data = np.frombuffer(encode(row), np.uint8)
    matrix[rank, :data.size] = data
    if not _summed(manager, pg, matrix):
        return None
    rows = [decode(r) for r in matrix]
    return None if any(r is None for r in rows) else rows


def initial_state(manager: Any, pg: Any, host: list, source: bool) -> list | None:
    """`host` (per leaf, this process's pieces) replaced by the source group's, bitwise:
    the pieces' bytes summed with zeros from every other group. None when it failed."""
    raw = [np.ascontiguousarray(v).reshape(-1).view(np.uint8) for values in host for v in values]
    total = sum(r.size for r in raw)
    if total == 0:
        return host
    flat = np.concatenate(raw) if source else np.zeros(total, np.uint8)
    if not _summed(manager, pg, flat):
        return None
    out, at = [], 0
    for values in host:
        row = []
        for v in values:
            size = v.size * v.dtype.itemsize
            row.append(flat[at:at + size].view(v.dtype).reshape(v.shape))
            at += size
        out.append(row)
    return out


def _summed(manager: Any, pg: Any, array: np.ndarray) -> bool:
    """Sum `array` in place over the quorum's groups; False when the all-reduce failed."""
    import torch
    from torch.distributed import ReduceOp
    manager.allreduce(torch.from_numpy(array), reduce_op=ReduceOp.SUM).wait()
    if manager.errored():
        pg.abort()   # the survivors still in the all-reduce fail now, not at their timeout
        return False
    return True
