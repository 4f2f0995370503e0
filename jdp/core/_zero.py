"""Sharded storage over the data axis: the optimizer state (ZeRO-1/2), and the parameters too
(FSDP / ZeRO-3): how the state is stored and updated.

Stored form: every optimiser-state leaf with a leading axis is padded on that axis to a multiple
of the device count N and sharded along `jdp.AXIS` (device i holds rows i*k..(i+1)*k); scalars
(Adam's `count`) stay replicated. The logical form (what optax sees) is the unpadded leaf.

The step reduce-scatters the gradients (`lax.psum_scatter`, each device receives the sum of its
1/N slice), then runs the optimiser *outside* the per-device code, on logical global arrays whose
shardings say "1/N per device": the compiler partitions `tx.update` so each device updates its
slice, and computes anything global (the norm of `clip_by_global_norm`, masks by shape, schedules
on `count`) exactly as unsharded optax would. The updates are all-gathered (in `comm_dtype` when
given) and added to the replicated parameters. Gradients are never whole after the reduction, so
this is ZeRO-2's gradient sharding too.

With the parameters sharded as well (`shard_params`), each parameter leaf is a `Sharded` node:
its rows padded and split along `jdp.AXIS` like an optimizer-state leaf, with its logical row
count kept in the tree's structure. Inside the step each device all-gathers the whole model
(in the compute dtype), takes its gradient and reduce-scatters it; the update runs on the
logical arrays as above and the parameters are stored again, never whole outside the step.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jdp.core import _mesh
from jdp.core._mesh import AXIS


@dataclasses.dataclass(frozen=True)
class Sharded:
    """A parameter stored 1/N per device: `value` has its rows padded to a multiple of the device
    count and split along `jdp.AXIS`; `rows` is the parameter's own row count."""

    value: Any
    rows: int


jax.tree_util.register_dataclass(Sharded, data_fields=["value"], meta_fields=["rows"])


def is_sharded(x: Any) -> bool:
    return isinstance(x, Sharded)


def padded_rows(rows: int, n: int) -> int:
    """`rows` rounded up to a multiple of `n`."""
    return -(-rows // n) * n


def _pad(x: Any, n: int) -> Any:
    """`x` padded with zeros on its leading axis to a multiple of `n` (numpy or jax)."""
    extra = padded_rows(x.shape[0], n) - x.shape[0]
    if not extra:
        return x
    lib = np if isinstance(x, np.ndarray) else jnp
    return lib.concatenate([x, lib.zeros((extra, *x.shape[1:]), x.dtype)])


def sharded_host(value: np.ndarray) -> tuple[np.ndarray, Any]:
    """(stored host value, sharding) of one optimiser-state leaf."""
    value = np.asarray(value)
    if value.ndim == 0:
        return value, _mesh.replicated()
    return _pad(value, _mesh.mesh().size), _mesh.batch_sharded()


def is_stored(opt_state: Any, logical: Any) -> bool:
    """Does `opt_state` have the stored (padded, sharded) form of `logical` shapes?"""
    n = _mesh.mesh().size
    want = jax.tree.map(lambda s: s.shape if not s.shape else
                        (padded_rows(s.shape[0], n), *s.shape[1:]), logical)
    have = jax.tree.map(lambda x: tuple(x.shape), opt_state)
    return jax.tree.structure(want) == jax.tree.structure(have) and jax.tree.leaves(
        want) == jax.tree.leaves(have)


def gathered(opt_state: Any, logical: Any) -> Any:
    """The stored optimizer state as its logical leaves, whole and replicated on every device."""
    unpad = lambda x, like: x[:like.shape[0]] if like.shape else x  # noqa: E731
    return jax.jit(lambda stored: jax.tree.map(unpad, stored, logical),
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

    `grad_rows` are padded global arrays sharded along the rows; the result's optimiser state
    is stored again (padded, sharded), and its parameters replicated, or stored again too when
    they are `Sharded`.
    """
    params = logical(state.params)
    grads = jax.tree.map(_unpad_like, grad_rows, params)
    logical_opt = jax.eval_shape(state.tx.init, params)
    opt_state = jax.tree.map(_unpad_like, state.opt_state, logical_opt)
    updates, opt_state = state.tx.update(grads, opt_state, params)
    opt_state = jax.tree.map(_store, opt_state)
    replicated = _mesh.replicated()

    def gather(u):  # the all-gather: every device gets all updated rows
        sent = u.astype(comm_dtype) if comm_dtype is not None else u
        return lax.with_sharding_constraint(sent, replicated).astype(u.dtype)

    def restore(old, new):  # a Sharded parameter is stored again; the rest replicated
        return Sharded(_store(new), old.rows) if is_sharded(old) else new

    sharded = any(is_sharded(x) for x in jax.tree.leaves(state.params, is_leaf=is_sharded))
    if sharded:
        new = optax.apply_updates(params, updates)
        params = jax.tree.map(restore, state.params, new, is_leaf=is_sharded)
    else:
        params = optax.apply_updates(params, jax.tree.map(gather, updates))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state)


def _rows_of(x: jax.Array, rows: int) -> jax.Array:
    """The first `rows` rows of a stored leaf, kept sharded by rows."""
    return lax.with_sharding_constraint(x[:rows], _mesh.batch_sharded())


def _unpad_like(x: jax.Array, like: Any) -> jax.Array:
    """The first `like.shape[0]` rows of `x` (the logical leaf), kept sharded by rows."""
    return _rows_of(x, like.shape[0]) if like.shape else x


def _store(x: jax.Array) -> jax.Array:
    """A logical optimiser-state leaf in its stored form: padded, sharded along the rows."""
    if not x.shape:
        return lax.with_sharding_constraint(x, _mesh.replicated())
    return lax.with_sharding_constraint(_pad(x, _mesh.mesh().size), _mesh.batch_sharded())


def shard_params_host(params: Any) -> Any:
    """Host parameters in their stored form: `Sharded` global arrays (scalars replicated)."""
    def one(x):
        x = np.asarray(x)
        placed = _mesh.place(*sharded_host(x))
        return Sharded(placed, x.shape[0]) if x.ndim else placed

    return jax.tree.map(one, params)


def logical(params: Any) -> Any:
    """Parameters in the model's own shapes (jit context): `Sharded` leaves unpadded, kept
    split by rows; other leaves as they are."""
    return jax.tree.map(lambda x: _rows_of(x.value, x.rows) if is_sharded(x) else x, params,
                        is_leaf=is_sharded)


def logical_shapes(params: Any) -> Any:
    """`jax.ShapeDtypeStruct`s of the parameters in the model's own shapes."""
    def one(x):
        if is_sharded(x):
            return jax.ShapeDtypeStruct((x.rows, *x.value.shape[1:]), x.value.dtype)
        return jax.ShapeDtypeStruct(jnp.shape(x), x.dtype)
    return jax.tree.map(one, params, is_leaf=is_sharded)


def logical_opt_state(state: Any) -> Any:
    """`jax.ShapeDtypeStruct`s of the optimizer state `tx.init` makes for the model's own
    parameter shapes: what ZeRO and FSDP store padded."""
    return jax.eval_shape(state.tx.init, logical_shapes(state.params))


def gather_params(params: Any, compute_dtype: Any) -> Any:
    """Inside shard_map: every device's copy of the whole model, in its own shapes, cast to
    `compute_dtype` before the all-gather (half the bytes for bfloat16)."""
    def one(x):
        if not is_sharded(x):
            return _cast(x, compute_dtype)
        whole = lax.all_gather(_cast(x.value, compute_dtype), AXIS, axis=0, tiled=True)
        return whole[:x.rows]
    return jax.tree.map(one, params, is_leaf=is_sharded)


def _cast(x: Any, dtype: Any) -> Any:
    return x.astype(dtype) if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x


def param_specs(params: Any) -> Any:
    """shard_map specs of stored parameters: `Sharded` values split by rows, the rest whole."""
    P = jax.sharding.PartitionSpec
    return jax.tree.map(lambda x: Sharded(P(AXIS), x.rows) if is_sharded(x) else P(), params,
                        is_leaf=is_sharded)
