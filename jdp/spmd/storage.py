"""Sharded storage over the data axis: the optimizer state (ZeRO-1/2), and the parameters too
(FSDP / ZeRO-3): how the state is stored and updated.

One rule for every stored leaf (`shard_axis`): a floating leaf is a `jax.Array` of its own
(the model's, or `tx.init`'s) shape, split along `jdp.AXIS` on an axis the device count
divides (ZeRO: the leading one where it can; FSDP: the largest, never the leading axis of a
leaf of 3 or more dimensions, which may be a stack of scanned layers: each layer is then split
alone), or kept whole (replicated) when no axis divides; scalars (Adam's `count`) and leaves
that are not floating (a PRNG key, a mask) stay replicated. Nothing is padded, so every JAX,
flax, optax and orbax function sees the model's numbers; `whole_leaves` says what is kept
whole.

The step reduce-scatters the gradients (`lax.psum_scatter` on each leaf's split axis, each
device receiving the sum of its 1/N slice), then runs the optimiser *outside* the per-device
code, on global arrays whose shardings say "1/N per device": the compiler partitions
`tx.update` so each device updates its slice, and computes anything global (the norm of
`clip_by_global_norm`, masks by shape, schedules on `count`) exactly as unsharded optax
would. The updates are all-gathered (in `comm_dtype` when given) and added to the replicated
parameters. Gradients are never whole after the reduction, so this is ZeRO-2's gradient
sharding too.

With the parameters split as well (`shard_params`), the step (`jdp/spmd/grads.py`'s
`mapped_grads`) leaves the gathers to the compiler, or to `jdp/spmd/layers.py` layer by
layer; the update runs on the split arrays and the parameters stay split, never whole outside
the step. HSDP (`shard_params=k` or "node") splits the same way within groups of k consecutive
devices (`_mesh.group_mesh`), replicated across them; its step (`_grads._grouped_grads`)
reduces across the groups once.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jdp.spmd import mesh as _mesh
from jdp.spmd.mesh import AXIS


def ways(group: int | None) -> int:
    """The devices one leaf is split over: a group's (HSDP), else the whole mesh's."""
    return group or _mesh.mesh().size


def shard_axis(shape: tuple[int, ...], n: int, fsdp: bool = True) -> int | None:
    """The axis a leaf of `shape` is split on over `n` devices, or None (kept whole) for a
    scalar and when no axis divides. ZeRO (`fsdp=False`): the leading axis when `n` divides it
    (a reduce-scatter of contiguous rows). Else the largest axis `n` divides: for 3 or more
    dimensions not the first, which may stack scanned layers (a layer split across its own
    rows lets the compiler gather it alone inside the loop); for 2 the later on a tie."""
    if not fsdp and shape and shape[0] % n == 0:
        return 0
    first = 1 if len(shape) >= 3 else 0
    fits = [a for a in range(first, len(shape)) if shape[a] and shape[a] % n == 0]
    if not fits:
        return None
    return max(fits, key=lambda a: (shape[a], a if len(shape) == 2 else -a))


def opt_axis(leaf: Any, n: int, fsdp: bool = True) -> int | None:
    """The axis an optimizer-state leaf (anything with a shape and dtype) is split on: its
    parameter's, by the same rule (the update then needs no reshuffle); None (replicated) for
    a leaf that is not floating: a PRNG key (`optax.add_noise`'s), a counter or a mask is one
    value, not rows to divide."""
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
        return None
    return shard_axis(tuple(leaf.shape), n, fsdp)


def split_on(axis: int | None, group: int | None = None) -> Any:
    """The sharding of a leaf split on `axis` along `jdp.AXIS`, or within groups of `group`
    devices and replicated across them (HSDP); None: replicated."""
    P = jax.sharding.PartitionSpec
    if group is None:
        spec = P() if axis is None else P(*[None] * axis, AXIS)
        return jax.sharding.NamedSharding(_mesh.mesh(), spec)
    spec = P() if axis is None else P(*[None] * axis, _mesh.SHARD)
    return jax.sharding.NamedSharding(_mesh.group_mesh(group), spec)


def stored_sharding(leaf: Any, group: int | None = None, fsdp: bool = True) -> Any:
    """Where a leaf of this shape and dtype is kept when it is stored split (`opt_axis`)."""
    return split_on(opt_axis(leaf, ways(group), fsdp), group)


def place_split(tree: Any, group: int | None = None, fsdp: bool = True) -> Any:
    """Host values every process holds, placed split as stored (FSDP's rule, or ZeRO's; over
    all devices, or within groups of `group`: HSDP)."""
    return jax.tree.map(lambda x: _mesh.place(x, stored_sharding(np.asarray(x), group, fsdp)),
                        tree)


def params_group(params: Any) -> int | None:
    """The group size the parameters are split within (HSDP), read from their shardings;
    None for all devices (or none split)."""
    for x in jax.tree.leaves(params):
        sharding = getattr(x, "sharding", None)
        if _mesh.SHARD in tuple(getattr(sharding, "spec", ())):
            return sharding.mesh.shape[_mesh.SHARD]
    return None


def split_axes(params: Any, group: int | None) -> Any:
    """Each parameter's split axis as stored (None: kept whole)."""
    return jax.tree.map(lambda x: opt_axis(x, ways(group)), params)


def whole_leaves(tree: Any, group: int | None = None) -> list[tuple[str, int]]:
    """(name, bytes) of the floating leaves with an axis that the split rule keeps whole on
    every device: no axis the device count divides (`shard_axis`)."""
    n = ways(group)
    return [(jax.tree_util.keystr(path), int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize)
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if jnp.ndim(x) and jnp.issubdtype(x.dtype, jnp.inexact) and opt_axis(x, n) is None]


def scatter_gradients(grads: Any, mean: bool, comm_dtype: Any) -> Any:
    """Inside shard_map: each device's 1/N slice of the summed or averaged gradient, on the
    leaf's split axis (whole, all-reduced, where the rule keeps it whole)."""
    n = lax.axis_size(AXIS)

    def one(g):
        sent = g.astype(comm_dtype or g.dtype)
        axis = shard_axis(g.shape, n, fsdp=False)
        if axis is None:
            total = lax.psum(sent, AXIS)
        else:
            total = lax.psum_scatter(sent, AXIS, scatter_dimension=axis, tiled=True)
        total = total.astype(g.dtype)
        return total / n if mean else total

    return jax.tree.map(one, grads)


def grad_specs(grads: Any) -> Any:
    """shard_map out_specs of `scatter_gradients`'s result: split as stored, else whole."""
    P = jax.sharding.PartitionSpec
    n = _mesh.mesh().size

    def one(g):
        axis = shard_axis(tuple(g.shape), n, fsdp=False)
        return P() if axis is None else P(*[None] * axis, AXIS)

    return jax.tree.map(one, grads)


def apply(state: Any, grads: Any, comm_dtype: Any, fsdp: bool = False,
          group: int | None = None) -> Any:
    """`state.apply_gradients` with the optimiser state and gradients split (jit context).

    `grads` are global arrays split as stored; the result's optimiser state is split again,
    and its parameters replicated (the updates all-gathered, in `comm_dtype`), or, under FSDP
    (`fsdp`, within groups of `group` under HSDP), split again as stored.
    """
    keep = lambda t, g=None: jax.tree.map(lambda x: _store(x, g, fsdp), t)  # noqa: E731
    grads = keep(grads, group)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    opt_state = keep(opt_state, group)
    replicated = _mesh.replicated()

    def gather(u):  # the all-gather: every device gets all updated rows
        sent = u.astype(comm_dtype) if comm_dtype is not None else u
        return lax.with_sharding_constraint(sent, replicated).astype(u.dtype)

    if fsdp:
        params = keep(optax.apply_updates(state.params, updates), group)
    else:
        params = optax.apply_updates(state.params, jax.tree.map(gather, updates))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state)


def _store(x: jax.Array, group: int | None = None, fsdp: bool = True) -> jax.Array:
    """A leaf kept as stored: split by the rule (`stored_sharding`), or replicated."""
    return lax.with_sharding_constraint(x, stored_sharding(x, group, fsdp))


def cast(tree: Any, dtype: Any) -> Any:
    """The floating leaves of `tree` in `dtype` (None: as they are)."""
    return jax.tree.map(lambda x: _cast(x, dtype), tree)


def _cast(x: Any, dtype: Any) -> Any:
    return x.astype(dtype) if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x
