"""Sharded storage over the data axis: the optimizer state (ZeRO-1/2), and the parameters too
(FSDP / ZeRO-3): how the state is stored and updated.

Stored form: every floating optimiser-state leaf with an axis is padded on one axis to a multiple
of the device count N and sharded along `jdp.AXIS` there (ZeRO: the leading axis, device i
holding rows i*k..(i+1)*k; FSDP: its parameter's axis); scalars (Adam's `count`) and other leaves
(a PRNG key, a mask) stay replicated. The logical form (what optax sees) is the unpadded leaf.

The step reduce-scatters the gradients (`lax.psum_scatter`, each device receives the sum of its
1/N slice), then runs the optimiser *outside* the per-device code, on logical global arrays whose
shardings say "1/N per device": the compiler partitions `tx.update` so each device updates its
slice, and computes anything global (the norm of `clip_by_global_norm`, masks by shape, schedules
on `count`) exactly as unsharded optax would. The updates are all-gathered (in `comm_dtype` when
given) and added to the replicated parameters. Gradients are never whole after the reduction, so
this is ZeRO-2's gradient sharding too.

With the parameters sharded as well (`shard_params`), each parameter leaf is a `Sharded` node
that reports the model's shape and dtype (and refuses to act as an array, naming
`jdp.unshard`): its value is padded on one axis (`shard_axis`: never
the leading axis of a leaf of 3 or more dimensions, which may be a stack of scanned layers) and
split along `jdp.AXIS` there, and its optimizer-state leaves are stored the same way. The step
(`jdp/core/_grads.py`'s `mapped_grads`) leaves the gathers to the compiler, so a scanned model
gathers one layer at a time; the update runs on the logical arrays as above and the parameters
are stored again, never whole outside the step. HSDP (`shard_params=k` or "node") stores the
same way within groups of k consecutive devices (`_mesh.group_mesh`), replicated across them;
its step (`_grads._grouped_grads`) reduces across the groups once.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.core import meta as flax_meta
from jax import lax

from jdp.core import _mesh
from jdp.core._mesh import AXIS
from jdp.distributed import devices_per_node


@dataclasses.dataclass(frozen=True, eq=False)
class Sharded:
    """A parameter stored 1/N per device: `value` is padded on `axis` to a multiple of the device
    count and split along `jdp.AXIS` there; `shape`, `dtype`, `ndim` and `size` are the
    parameter's own (the model's), like a PyTorch FSDP2 DTensor's.

    It is not an array: `np.asarray(leaf)` gives the model-shaped value (gathered to this host,
    for inspection); array arithmetic, indexing, `jnp.asarray` and array methods, in or out of
    `jax.jit`, raise a one-line TypeError naming `jdp.unshard`, since a silent gather of every
    parameter inside a user's function would undo FSDP's memory saving.
    """

    value: Any
    shape: tuple[int, ...]
    axis: int
    group: int | None = None   # HSDP: split within groups of this many devices; None: all

    @property
    def dtype(self) -> Any:   # None when a tree map put a non-array (a shape, a spec) inside
        return getattr(self.value, "dtype", None)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return (f"Sharded(shape={self.shape}, dtype={self.dtype}, split on axis {self.axis} "
                f"over {'all devices' if self.group is None else f'groups of {self.group}'})")

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if isinstance(self.value, jax.core.Tracer):   # inside the user's jit: a gather
            raise TypeError(self._not_an_array("np.asarray inside jax.jit"))
        if not getattr(self.value, "is_fully_addressable", True):
            raise TypeError(self._not_an_array(
                "np.asarray of a parameter split over several processes",
                "jdp.unshard(state.params) on every process, then np.asarray"))
        whole = np.asarray(jax.device_get(self.value))[tuple(slice(0, d) for d in self.shape)]
        return whole.astype(dtype) if dtype is not None else whole

    def __jax_array__(self) -> Any:
        raise TypeError(self._not_an_array("a JAX array of it (jnp.asarray, or a jnp/lax op)"))

    __array_ufunc__ = None   # numpy operators defer to the dunders below, which say what to do

    def unbox(self) -> Any:   # flax unboxes a parameter (`meta.unbox`) before a module uses it
        raise TypeError(self._not_an_array("model.apply(state.params, ...)"))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("value", "shape", "axis", "group"):
            raise AttributeError(name)   # protocol probes, and fields not yet set (a copy)
        raise AttributeError(self._not_an_array(f".{name}"))

    def _not_an_array(self, use: str, fix: str = "jdp.unshard(state.params)") -> str:
        option = True if self.group is None else self.group
        return (f"{use}: this parameter of shape {self.shape} is stored sharded by "
                f"jdp.broadcast(shard_params={option!r}), not as an array; call {fix} (or "
                "jdp.unshard(state)) for the model's arrays, or train with "
                f"jdp.train_step(..., shard_params={option!r})")


def _refuse(use: str) -> Any:
    def op(self: Sharded, *other: Any) -> Any:
        raise TypeError(self._not_an_array(use))
    return op


for _name, _symbol in [("add", "+"), ("sub", "-"), ("mul", "*"), ("truediv", "/"),
                       ("floordiv", "//"), ("mod", "%"), ("pow", "**"), ("matmul", "@"),
                       ("and", "&"), ("or", "|"), ("xor", "^")]:
    setattr(Sharded, f"__{_name}__", _refuse(f"parameter {_symbol} x"))
    setattr(Sharded, f"__r{_name}__", _refuse(f"x {_symbol} parameter"))
for _name, _symbol in [("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">="), ("eq", "=="),
                       ("ne", "!=")]:   # Python reflects a comparison into its mirror image
    setattr(Sharded, f"__{_name}__", _refuse(f"parameter {_symbol} x"))
for _name, _use in [("neg", "-parameter"), ("pos", "+parameter"), ("abs", "abs(parameter)"),
                    ("invert", "~parameter"), ("getitem", "parameter[...]")]:
    setattr(Sharded, f"__{_name}__", _refuse(_use))


jax.tree_util.register_dataclass(Sharded, data_fields=["value"],
                                 meta_fields=["shape", "axis", "group"])
# A flax module takes a parameter box (flax's `AxisMetadata`, e.g. `nn.Partitioned`) apart with
# `unbox()` before use: as one, a `Sharded` parameter says what to do, not a shape mismatch.
flax_meta.AxisMetadata.register(Sharded)


def group_size(shard_params: Any) -> int | None:
    """The devices one parameter is split over for a `shard_params` value: None for all of
    them (True), `k` for groups of k consecutive devices, a node's devices for "node"
    (this process's devices x the processes per node); refused otherwise."""
    n = _mesh.mesh().size
    k = shard_params.item() if isinstance(shard_params, np.generic) else shard_params
    if k == "node":
        k = devices_per_node()
    if k is True:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k < 2 or n % k:
        raise ValueError(f"shard_params={shard_params!r}: expected True (all {n} devices), "
                         f"\"node\", or an int >= 2 that divides the device count {n} (HSDP: "
                         "groups of that many consecutive devices)")
    return None if k == n else k


def shard_axis(shape: tuple[int, ...]) -> int | None:
    """The axis FSDP splits a leaf of `shape` on: None for a scalar; for 3 or more dimensions
    the largest axis after the first (the first may stack scanned layers, and a layer split
    across its own rows lets the compiler gather it alone inside the loop); else the larger."""
    if not shape:
        return None
    if len(shape) >= 3:
        return 1 + int(np.argmax(shape[1:]))
    return 1 if len(shape) == 2 and shape[1] >= shape[0] else 0


def opt_axis(leaf: Any, fsdp: bool) -> int | None:
    """The axis an optimizer-state leaf (anything with a shape and dtype) is stored split on:
    its parameter's under FSDP (the update then needs no reshuffle), the leading axis under
    ZeRO; None (replicated) for a scalar, and for a leaf that is not floating: a PRNG key
    (`optax.add_noise`'s), a counter or a mask is one value, not rows to divide, and padding
    it would make it another value."""
    shape = tuple(leaf.shape)
    if not shape or not jnp.issubdtype(leaf.dtype, jnp.inexact):
        return None
    return shard_axis(shape) if fsdp else 0


def is_sharded(x: Any) -> bool:
    return isinstance(x, Sharded)


def padded_rows(rows: int, n: int) -> int:
    """`rows` rounded up to a multiple of `n`."""
    return -(-rows // n) * n


def _pad(x: Any, n: int, axis: int = 0) -> Any:
    """`x` padded with zeros on `axis` to a multiple of `n` (numpy or jax)."""
    extra = padded_rows(x.shape[axis], n) - x.shape[axis]
    if not extra:
        return x
    lib = np if isinstance(x, np.ndarray) else jnp
    return lib.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])


def split_on(axis: int | None, group: int | None = None) -> Any:
    """The sharding of a leaf split on `axis` along `jdp.AXIS`, or within groups of `group`
    devices and replicated across them (HSDP); None: replicated."""
    P = jax.sharding.PartitionSpec
    if axis is None:
        return _mesh.replicated()
    if group is None:
        return jax.sharding.NamedSharding(_mesh.mesh(), P(*[None] * axis, AXIS))
    return jax.sharding.NamedSharding(_mesh.group_mesh(group), P(*[None] * axis, _mesh.SHARD))


def _ways(group: int | None) -> int:
    return group or _mesh.mesh().size


def sharded_host(value: np.ndarray, fsdp: bool = False,
                 group: int | None = None) -> tuple[np.ndarray, Any]:
    """(stored host value, sharding) of one optimiser-state leaf."""
    value = np.asarray(value)
    axis = opt_axis(value, fsdp)
    if axis is None:
        return value, _mesh.replicated()
    return _pad(value, _ways(group), axis), split_on(axis, group)


def _padded_shape(shape: tuple[int, ...], axis: int | None, n: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(shape)
    return tuple(padded_rows(d, n) if a == axis else d for a, d in enumerate(shape))


def is_stored(opt_state: Any, logical: Any, group: int | None = None) -> bool:
    """Does `opt_state` have a stored (padded, sharded: ZeRO's or FSDP's) form of `logical`?"""
    n = _ways(group)
    have = jax.tree.map(lambda x: tuple(x.shape), opt_state)
    for fsdp in (False, True):
        want = jax.tree.map(lambda s, f=fsdp: _padded_shape(s.shape, opt_axis(s, f), n),
                            logical)
        if jax.tree.structure(want) == jax.tree.structure(have) and jax.tree.leaves(
                want) == jax.tree.leaves(have):
            return True
    return False


def _unpad(x: Any, like: Any) -> Any:
    """The logical part of a stored leaf: its first `like.shape` elements on every axis."""
    return x[tuple(slice(0, d) for d in like.shape)] if like.shape else x


def gathered(opt_state: Any, logical: Any) -> Any:
    """The stored optimizer state as its logical leaves, whole and replicated on every device."""
    return jax.jit(lambda stored: jax.tree.map(_unpad, stored, logical),
                   out_shardings=_mesh.replicated())(opt_state)


def scatter_gradients(grads: Any, mean: bool, comm_dtype: Any) -> Any:
    """Inside shard_map: each device's 1/N slice (rows) of the summed or averaged gradient."""
    n = lax.axis_size(AXIS)

    def one(g):
        if g.ndim == 0:
            total = lax.psum(g, AXIS)
            return total / n if mean else total
        sent = _pad(g, n).astype(comm_dtype or g.dtype)
        part = lax.psum_scatter(sent, AXIS, scatter_dimension=0, tiled=True).astype(g.dtype)
        return part / n if mean else part

    return jax.tree.map(one, grads)


def grad_specs(grads: Any) -> Any:
    """shard_map out_specs of `scatter_gradients`'s result: rows split, scalars replicated."""
    return jax.tree.map(lambda g: jax.sharding.PartitionSpec() if g.ndim == 0
                        else jax.sharding.PartitionSpec(AXIS), grads)


def apply(state: Any, grad_rows: Any, comm_dtype: Any) -> Any:
    """`state.apply_gradients` with the optimiser state and gradients sharded (jit context).

    `grad_rows` are global arrays sharded along the rows (ZeRO: padded) or as the parameters
    (FSDP); the result's optimiser state is stored again (padded, sharded), and its parameters
    replicated, or stored again too when they are `Sharded`.
    """
    sharded = any(is_sharded(x) for x in jax.tree.leaves(state.params, is_leaf=is_sharded))
    group = params_group(state.params)
    params = logical(state.params)
    grads = jax.tree.map(lambda g, p: _unpad_like(g, p, sharded, group), grad_rows, params)
    logical_opt = jax.eval_shape(state.tx.init, params)
    opt_state = jax.tree.map(lambda x, like: _unpad_like(x, like, sharded, group),
                             state.opt_state, logical_opt)
    updates, opt_state = state.tx.update(grads, opt_state, params)
    opt_state = jax.tree.map(lambda x: _store(x, opt_axis(x, sharded), group), opt_state)
    replicated = _mesh.replicated()

    def gather(u):  # the all-gather: every device gets all updated rows
        sent = u.astype(comm_dtype) if comm_dtype is not None else u
        return lax.with_sharding_constraint(sent, replicated).astype(u.dtype)

    def restore(old, new):  # a Sharded parameter is stored again; the rest replicated
        if not is_sharded(old):
            return new
        return Sharded(_store(new, old.axis, old.group), old.shape, old.axis, old.group)

    if sharded:
        new = optax.apply_updates(params, updates)
        params = jax.tree.map(restore, state.params, new, is_leaf=is_sharded)
    else:
        params = optax.apply_updates(params, jax.tree.map(gather, updates))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state)


def _logical_of(x: jax.Array, like: Any, axis: int | None, group: int | None) -> jax.Array:
    """The logical part of a stored leaf, kept split on `axis`."""
    if not like.shape:
        return x
    return lax.with_sharding_constraint(_unpad(x, like), split_on(axis, group))


def _unpad_like(x: jax.Array, like: Any, fsdp: bool = False, group: int | None = None):
    """The logical leaf (`like`'s shape) of a stored one, kept split as stored."""
    return _logical_of(x, like, opt_axis(like, fsdp), group)


def _store(x: jax.Array, axis: int | None, group: int | None = None) -> jax.Array:
    """A logical leaf in its stored form: padded and split on `axis` (None: replicated)."""
    if axis is None:
        return lax.with_sharding_constraint(x, _mesh.replicated())
    return lax.with_sharding_constraint(_pad(x, _ways(group), axis), split_on(axis, group))


def shard_params_host(params: Any, group: int | None = None) -> Any:
    """Host parameters in their stored form: `Sharded` global arrays (scalars replicated),
    split over all devices or within groups of `group` (HSDP)."""
    def one(x):
        x = np.asarray(x)
        placed = _mesh.place(*sharded_host(x, fsdp=True, group=group))
        return Sharded(placed, x.shape, shard_axis(x.shape), group) if x.ndim else placed

    return jax.tree.map(one, params)


def params_group(params: Any) -> int | None:
    """The group size the `Sharded` parameters are split within (None: all devices)."""
    return next((x.group for x in jax.tree.leaves(params, is_leaf=is_sharded)
                 if is_sharded(x)), None)


def split_axes(params: Any) -> Any:
    """Each parameter's split axis as stored (`Sharded.axis`; None for a replicated leaf)."""
    return jax.tree.map(lambda x: x.axis if is_sharded(x) else None, params,
                        is_leaf=is_sharded)


def logical(params: Any) -> Any:
    """Parameters in the model's own shapes (jit context): `Sharded` leaves unpadded, kept
    split as stored; other leaves as they are."""
    return jax.tree.map(lambda x: _logical_of(x.value, x, x.axis, x.group) if is_sharded(x)
                        else x, params, is_leaf=is_sharded)


def logical_shapes(params: Any) -> Any:
    """`jax.ShapeDtypeStruct`s of the parameters in the model's own shapes."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape if is_sharded(x) else jnp.shape(x), x.dtype), params, is_leaf=is_sharded)


def logical_opt_state(state: Any) -> Any:
    """`jax.ShapeDtypeStruct`s of the optimizer state `tx.init` makes for the model's own
    parameter shapes: what ZeRO and FSDP store padded."""
    return jax.eval_shape(state.tx.init, logical_shapes(state.params))


def cast(tree: Any, dtype: Any) -> Any:
    """The floating leaves of `tree` in `dtype` (None: as they are)."""
    return jax.tree.map(lambda x: _cast(x, dtype), tree)


def _cast(x: Any, dtype: Any) -> Any:
    return x.astype(dtype) if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x
