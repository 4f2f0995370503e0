"""The cross-group all-reduce's buffers, made on the devices and copied once each way.

A group's gradients, model state and metrics are global arrays, each leaf split or replicated
over the group's devices. `Buffers.of` plans, per device, one flat buffer per wire dtype
(float32, or float64 for float64 leaves): a split leaf's own piece, and 1/k of a leaf held by
k devices alike (each copy's own slice, so a process sends every value it holds once). The
buffers are filled inside one compiled function (`flatten`), cross to the host once per
device (on CPU not at all: the host tensor is the device's own memory), are summed in place
by the all-reduce, cross back once (`back`), and are unflattened inside another compiled
function (`unflatten`: divided by the groups' count where a mean is asked, the replicas'
slices gathered on the devices, cast back to each leaf's dtype). Every group has the same
layout, so the process of the same rank in every group holds the same buffers in the same
order, and they reduce element by element.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdp.ft import _exchange

ONE = "jdp_one"
"""The axis of the one-device mesh a single-device leaf is planned on."""


@dataclasses.dataclass(frozen=True)
class Leaf:
    """Where one floating leaf lies in its device's buffer."""
    index: int            # among the tree's leaves
    spec: Any             # its PartitionSpec on the plan's mesh
    shape: tuple          # one device's piece
    dtype: Any
    wire: str             # the buffer's dtype
    replicas: tuple       # the mesh axes its piece is copied over
    k: int                # how many devices hold the same piece
    divide: bool          # a mean: divided by the groups' count

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def part(self) -> int:
        """This device's share of the piece, in elements (the piece padded to k parts)."""
        return -(-self.size // self.k)


def wire_dtype(dtype: Any) -> str | None:
    """The dtype a leaf travels in: float64 as itself, other floats as float32, else None
    (not exchanged: integers and keys stay each group's own)."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    return "float64" if jnp.dtype(dtype) == jnp.float64 else "float32"


def _placement(leaf: jax.Array) -> tuple[Mesh, Any]:
    sharding = leaf.sharding
    if isinstance(sharding, NamedSharding):
        return sharding.mesh, sharding.spec
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return Mesh(np.array(list(sharding.device_set)), (ONE,)), P()
    raise TypeError(f"jdp.ft: a leaf placed by {type(sharding).__name__} cannot be exchanged; "
                    "the step's outputs are NamedSharding on its mesh")


def _copied_over(mesh: Mesh, spec: Any) -> tuple:
    used = set()
    for entry in spec:
        used.update(entry if isinstance(entry, tuple) else (entry,))
    return tuple(a for a in mesh.axis_names if a not in used)


class Buffers:
    """The plan of one tree's buffers (see the module's docstring); built once per tree
    signature (`of`), it compiles its two functions at first use."""

    def __init__(self, tree: Any, divide: tuple):
        leaves, self.treedef = jax.tree.flatten(tree)
        self.meshes: list = []   # (mesh, [Leaf], wire dtypes in order)
        by_mesh: dict = {}
        for i, (leaf, div) in enumerate(zip(leaves, divide, strict=True)):
            wire = wire_dtype(leaf.dtype)
            if wire is None or leaf.size == 0:
                continue
            mesh, spec = _placement(leaf)
            over = _copied_over(mesh, spec)
            k = math.prod(mesh.shape[a] for a in over)
            plan = Leaf(i, spec, tuple(leaf.sharding.shard_shape(leaf.shape)), leaf.dtype, wire,
                        over, k, div)
            by_mesh.setdefault(mesh, []).append(plan)
        for mesh, plans in by_mesh.items():
            wires = tuple(sorted({p.wire for p in plans}))
            self.meshes.append((mesh, plans, wires))
        self._flatten = [_flattener(m, tuple(p), w) for m, p, w in self.meshes]
        self._unflatten = [_unflattener(m, tuple(p), w) for m, p, w in self.meshes]

    @staticmethod
    def of(tree: Any, divide: tuple, plans: dict | None = None) -> Buffers:
        """The plan for `tree` (its structure, shapes, dtypes and placements), kept in
        `plans` by that signature when given (a step's tree keeps one; a few at most), so
        that its compiled functions are made once."""
        if plans is None:
            return Buffers(tree, divide)
        leaves, treedef = jax.tree.flatten(tree)
        key = (treedef, tuple((x.shape, x.dtype, x.sharding) for x in leaves), divide)
        if key not in plans:
            if len(plans) >= 8:
                plans.clear()
            plans[key] = Buffers(tree, divide)
        return plans[key]

    def flatten(self, tree: Any) -> list:
        """The buffers as global arrays, one per mesh and wire dtype, each split over its
        mesh's devices (dispatched, not waited for)."""
        leaves = jax.tree.leaves(tree)
        out = []
        for fn, (_, plans, _) in zip(self._flatten, self.meshes, strict=True):
            out.extend(fn(*[leaves[p.index] for p in plans]))
        return out

    def unflatten(self, buffers: list, tree: Any, groups: int) -> Any:
        """`tree` with each exchanged leaf replaced by its reduced value from `buffers`
        (divided by `groups` where a mean), placed as before."""
        leaves = list(jax.tree.leaves(tree))
        at = 0
        for fn, (_, plans, wires) in zip(self._unflatten, self.meshes, strict=True):
            mine = buffers[at:at + len(wires)]
            at += len(wires)
            for plan, value in zip(plans, fn(np.float32(groups), *mine), strict=True):
                leaves[plan.index] = value
        return jax.tree.unflatten(self.treedef, leaves)


def copying(buffers: list) -> None:
    """Start each local piece of `buffers` on its way to the host (`to_host` then waits only
    for what is left)."""
    for b in buffers:
        for _, s in _exchange.pieces(b):
            s.data.copy_to_host_async()


def to_host(buffers: list) -> list:
    """Per buffer, per local device in mesh order, a writable torch tensor of its values:
    the device's own memory on CPU, else one device-to-host copy."""
    import torch
    shards = [s for b in buffers for _, s in _exchange.pieces(b)]
    copying(buffers)
    return [torch.from_dlpack(s.data) if s.device.platform == "cpu"
            else torch.from_numpy(_writable(np.asarray(s.data))) for s in shards]


def _writable(values: np.ndarray) -> np.ndarray:
    """`values` writable in place: a fresh host copy owns its memory, so the flag can be
    set; else (a view) one more copy."""
    try:
        values.flags.writeable = True
        return values
    except ValueError:
        return values.copy()


def back(buffers: list, host: list) -> list:
    """`buffers` again, holding `host`'s values (`to_host`'s order): one host-to-device copy
    per device (none on CPU, where the arrays take the host memory as it is)."""
    out, at = [], 0
    for b in buffers:
        shards = [s for _, s in _exchange.pieces(b)]
        arrays = [jax.device_put(t.numpy(), s.device)
                  for t, s in zip(host[at:at + len(shards)], shards, strict=True)]
        at += len(shards)
        out.append(jax.make_array_from_single_device_arrays(b.shape, b.sharding, arrays))
    return out


def _replica_index(axes: tuple) -> jax.Array:
    """This device's position among the devices that hold its piece (row-major over `axes`,
    the order `lax.all_gather` over the same axes uses)."""
    index = jnp.int32(0)
    for a in axes:
        index = index * lax.axis_size(a) + lax.axis_index(a)
    return index


def _flattener(mesh: Mesh, plans: tuple, wires: tuple):
    def per_device(*pieces):
        parts: dict = {w: [] for w in wires}
        for x, p in zip(pieces, plans, strict=True):
            flat = x.reshape(-1).astype(p.wire)
            if p.k > 1:
                if p.size % p.k:
                    flat = jnp.pad(flat, (0, p.part * p.k - p.size))
                flat = lax.dynamic_slice_in_dim(flat, _replica_index(p.replicas) * p.part,
                                                p.part)
            parts[p.wire].append(flat)
        return tuple(jnp.concatenate(parts[w]) for w in wires)
    every = P(mesh.axis_names)
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=tuple(p.spec for p in plans),
                                 out_specs=tuple(every for _ in wires), check_vma=False))


def _unflattener(mesh: Mesh, plans: tuple, wires: tuple):
    def per_device(groups, *buffers):
        by_wire = dict(zip(wires, buffers, strict=True))
        offsets = dict.fromkeys(wires, 0)
        out = []
        for p in plans:
            at = offsets[p.wire]
            part = by_wire[p.wire][at:at + p.part]
            offsets[p.wire] = at + p.part
            if p.divide:
                part = part / groups.astype(p.wire)
            if p.k > 1:   # each copy's slice, from every copy: the leaf whole on each
                part = lax.all_gather(part, p.replicas, tiled=True)
                if p.size % p.k:
                    part = part[:p.size]
            out.append(part.reshape(p.shape).astype(p.dtype))
        return tuple(out)
    every = P(mesh.axis_names)
    return jax.jit(jax.shard_map(per_device, mesh=mesh,
                                 in_specs=(P(), *[every for _ in wires]),
                                 out_specs=tuple(p.spec for p in plans), check_vma=False))
