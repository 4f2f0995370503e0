"""Optimizer-state sharding (ZeRO-1/2) over the data axis: how the state is stored and updated.

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
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jdp.core import _mesh
from jdp.core._mesh import AXIS


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
    is stored again (padded, sharded) and its parameters replicated.
    """
    grads = jax.tree.map(_unpad_like, grad_rows, state.params)
    logical = jax.eval_shape(state.tx.init, state.params)
    opt_state = jax.tree.map(_unpad_like, state.opt_state, logical)
    updates, opt_state = state.tx.update(grads, opt_state, state.params)
    opt_state = jax.tree.map(_store, opt_state)
    replicated = _mesh.replicated()

    def gather(u):  # the all-gather: every device gets all updated rows
        sent = u.astype(comm_dtype) if comm_dtype is not None else u
        return lax.with_sharding_constraint(sent, replicated).astype(u.dtype)

    params = optax.apply_updates(state.params, jax.tree.map(gather, updates))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state)


def _unpad_like(x: jax.Array, like: Any) -> jax.Array:
    """The first `like.shape[0]` rows of `x` (the logical leaf), kept sharded by rows."""
    if not like.shape:
        return x
    rows = x[:like.shape[0]]
    return lax.with_sharding_constraint(rows, _mesh.batch_sharded())


def _store(x: jax.Array) -> jax.Array:
    """A logical optimiser-state leaf in its stored form: padded, sharded along the rows."""
    if not x.shape:
        return lax.with_sharding_constraint(x, _mesh.replicated())
    return lax.with_sharding_constraint(_pad(x, _mesh.mesh().size), _mesh.batch_sharded())
