"""A pytree of global arrays as this process's host buffers, and back.

Across replica groups each process exchanges exactly what it holds: per leaf, the distinct
pieces on its devices (one copy of a replicated leaf; its own rows of a split one). Every
group has the same layout, so the process of the same rank in every group holds the same
pieces, in the same order. On CPU a piece is read without a copy (`np.asarray` of a CPU
buffer). A heal's state and a fresh job's initial one travel this way, bitwise; the
gradients' all-reduce has its own buffers (`_buffers`).
"""
from __future__ import annotations

import zlib
from typing import Any

import jax
import numpy as np


def _key(index: tuple) -> tuple:
    return tuple((s.start or 0) if isinstance(s, slice) else s for s in index)


def pieces(leaf: jax.Array) -> list:
    """The distinct addressable pieces of `leaf` as `(key, shard)`, ordered by position."""
    seen: dict = {}
    for shard in leaf.addressable_shards:
        seen.setdefault(_key(shard.index), shard)
    return sorted(seen.items())


def to_host(tree: Any) -> list:
    """Per leaf, its pieces' values as numpy arrays (views on CPU)."""
    return [[np.asarray(s.data) for _, s in pieces(leaf)] for leaf in jax.tree.leaves(tree)]


def from_host(like: Any, host: list) -> Any:
    """Global arrays shaped and placed as `like`'s leaves, holding `host` (as `to_host`
    gives): each device gets the piece at its own index."""
    leaves, treedef = jax.tree.flatten(like)
    out = []
    for leaf, values in zip(leaves, host, strict=True):
        by_key = {key: v for (key, _), v in zip(pieces(leaf), values, strict=True)}
        arrays = [jax.device_put(np.asarray(by_key[_key(s.index)], leaf.dtype), s.device)
                  for s in leaf.addressable_shards]
        out.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, arrays))
    return jax.tree.unflatten(treedef, out)


def to_wire(host: list) -> list:
    """`host` as torch byte tensors with their dtype and shape, for torchft's state transfer:
    raw bytes, so every dtype (bfloat16, integers, raw keys) arrives bitwise."""
    import torch
    return [[(torch.from_numpy(np.array(v, copy=True).reshape(-1).view(np.uint8)),
              v.dtype.name, v.shape) for v in values] for values in host]


def from_wire(wire: list) -> list:
    """`to_wire`'s inverse: numpy arrays."""
    return [[t.numpy().view(_dtype(name)).reshape(shape) for t, name, shape in values]
            for values in wire]


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:   # bfloat16 and the other ml_dtypes JAX registers by name
        return np.dtype(getattr(jax.numpy, name))


def digest(wire: list) -> str:
    """A CRC-32 of `to_wire`'s bytes, dtypes and shapes: equal states, equal digests (how the
    tests and the events show a heal arrived bitwise)."""
    crc = 0
    for values in wire:
        for t, name, shape in values:
            crc = zlib.crc32(t.numpy().tobytes(), zlib.crc32(f"{name}{shape}".encode(), crc))
    return f"{crc:08x}"
