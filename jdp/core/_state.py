"""Train state across devices, in jdp's two layouts, and the TrainState that carries it.

**Global** (`broadcast`): every array leaf is one global `jax.Array`, fully replicated on
`jdp.mesh()`; `state.params` is the parameters, `jax.device_get(state)` one copy. **Stacked**
(`replicate`, the classic pmap form): every leaf carries a leading axis of
`jax.local_device_count()`, one copy per local device. Both start from process 0's values, as
DDP broadcasts rank 0's parameters at construction. `layout(state)` tells them apart; this
module is the one home of the stacked layout's conventions (`[n*b] -> [n, b]`, "device 0's
copy", "leading axis == local devices").
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax.training import train_state
from jax.sharding import NamedSharding

from jdp.core import _mesh, _zero
from jdp.distributed import broadcast_from_primary

GLOBAL, STACKED = _mesh.GLOBAL, _mesh.STACKED


class TrainState(train_state.TrainState):
    """flax's TrainState plus the model's non-trained state and an RNG key.

    `model_state` holds what the forward pass updates but the optimiser does not (flax
    `batch_stats`, an NNX `BatchStat` state); `jdp.train_step` hands it to the loss and keeps
    it in sync across devices. `rng` is a raw `uint32[2]` key: each step derives a key per
    device and per step from it, so dropout differs across devices and reruns reproduce.

    Example:
        >>> import optax
        >>> state = jdp.TrainState.create(apply_fn=None, params={"w": np.zeros(3)},
        ...                               tx=optax.sgd(0.1), seed=0)
        >>> state.rng.shape, int(state.step)
        ((2,), 0)
    """

    model_state: Any = None
    rng: Any = None

    @classmethod
    def create(cls, *, apply_fn, params, tx, model_state=None, seed: int | None = None,
               **kwargs) -> TrainState:
        """Create a state with optimiser state from `tx`; `seed` sets `rng`."""
        if seed is not None and kwargs.get("rng") is None:
            kwargs["rng"] = jax.random.key_data(jax.random.key(seed))
        return super().create(apply_fn=apply_fn, params=params, tx=tx,
                              model_state=model_state, **kwargs)


def broadcast(tree: Any, *, shard_optimizer: bool = False) -> Any:
    """Place `tree` on every device of every process as global arrays (the global layout).

    Each array leaf becomes a `jax.Array` fully replicated on `jdp.mesh()`
    (`NamedSharding(mesh, P())`) holding process 0's values, as DDP broadcasts rank 0's
    parameters, so replicas start identical even if processes were seeded differently. There
    is no device axis: `state.params` is the parameters and `float(metrics["loss"])` works.

    Args:
        tree: a pytree of arrays (a TrainState, params, ...), one copy.
        shard_optimizer: ZeRO-1: place the optimiser state (`tree.opt_state`) sharded along
            `jdp.AXIS` instead, each device holding 1/N of it (leaves padded on their leading
            axis to a multiple of N; scalars replicated); it never exists whole on a device.
            Use it with `jdp.train_step(..., shard_optimizer=True)`.

    Returns:
        The same structure with global `jax.Array` leaves.

    Example:
        >>> state = jdp.broadcast({"w": np.ones(3)})
        >>> state["w"].sharding.is_fully_replicated, state["w"].shape
        (True, (3,))
    """
    host = broadcast_from_primary(tree)
    placed = jax.tree.map(lambda x: _place(x, _mesh.replicated()), host)
    if not shard_optimizer:
        return placed
    if not hasattr(host, "opt_state"):
        raise TypeError(f"jdp.broadcast(shard_optimizer=True): {type(tree).__name__} has no "
                        "opt_state field; pass the TrainState (jdp.TrainState or flax's)")
    opt_state = jax.tree.map(lambda x: _place(*_zero.sharded_host(x)), host.opt_state)
    return placed.replace(opt_state=opt_state)


def _place(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host value every process holds: each device gets its part."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def replicate(tree: Any) -> Any:
    """Put one copy of every leaf of `tree` on each local device (the classic pmap layout).

    Leaves gain a leading axis of size `jax.local_device_count()`. On a multi-process run every
    process ends up with process 0's values, as DDP broadcasts rank 0's parameters at
    construction, so replicas start identical even if processes were seeded differently.

    Args:
        tree: a pytree of arrays (a TrainState, params, ...), one copy, not replicated.

    Returns:
        The same structure with `jax.Array` leaves sharded over the local devices.

    Example:
        >>> jdp.replicate({"w": np.ones(3)})["w"].shape == (jax.local_device_count(), 3)
        True
    """
    sharding = _mesh.local_sharding()
    n = len(sharding.device_set)
    return jax.tree.map(lambda x: jax.device_put(np.broadcast_to(x, (n, *np.shape(x))),
                                                 sharding), broadcast_from_primary(tree))


def unreplicate(tree: Any) -> Any:
    """One copy of a state or metrics in either layout: device 0's of a stacked tree.

    Stacked leaves (`[local_devices, ...]`, from `replicate` or a pmap-layout step) lose their
    device axis; global leaves (from `broadcast` or a global-layout step) are already one copy
    and come back unchanged, so code written for both layouts can call it.

    Raises:
        ValueError: a stacked-looking leaf whose leading axis is not the local device count
            (it was never replicated: taking its row 0 would silently drop data).

    Example:
        >>> jdp.unreplicate(jdp.replicate({"w": np.ones(3)}))["w"].shape
        (3,)
    """
    n = jax.local_device_count()

    def first(path, x):
        if layout_of_leaf(x) == GLOBAL:
            return x
        if np.ndim(x) == 0 or np.shape(x)[0] != n:
            raise ValueError(
                f"jdp.unreplicate: leaf {jax.tree_util.keystr(path) or '<root>'} has shape "
                f"{np.shape(x)}, not a leading axis of {n} local devices: it is not replicated. "
                "Pass what jdp.replicate or a pmap-layout step returned, or use the value as is")
        if isinstance(x, jax.Array) and x.is_fully_addressable:
            return x.addressable_data(0)[0] if x.addressable_data(0).shape[0] == 1 else x[0]
        return x[0]

    return jax.tree_util.tree_map_with_path(first, tree)


def shard(tree: Any, *, layout: str = STACKED) -> Any:
    """Feed a batch held by this process to a jdp step without the Loader.

    `layout="pmap"`: split each leaf's leading axis over the local devices, `[n*b, ...] ->
    [n, b, ...]`. `layout="global"`: make each leaf one global array `[processes*n*b, ...]`
    sharded along `jdp.AXIS`, this process's rows on its own devices.

    Raises:
        ValueError: a leaf's leading axis is not divisible by the local device count.

    Example:
        >>> n = jax.local_device_count()
        >>> jdp.shard({"x": np.zeros((2 * n, 3))})["x"].shape == (n, 2, 3)
        True
        >>> jdp.shard({"x": np.zeros((2 * n, 3))}, layout="global")["x"].shape == (2 * n, 3)
        True
    """
    if layout not in _mesh.LAYOUTS:
        raise ValueError(f"jdp.shard: layout={layout!r}; expected 'pmap' or 'global'")
    n = jax.local_device_count()

    def split(path, x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if x.ndim == 0 or x.shape[0] % n:
            raise ValueError(
                f"jdp.shard: leaf {jax.tree_util.keystr(path) or 'batch'} has shape {x.shape}; "
                f"its leading axis must be divisible by the {n} local devices: pick a batch size "
                f"that is a multiple of {n}")
        return x

    return _mesh.place_batch(jax.tree_util.tree_map_with_path(split, tree), layout)


def layout_of_leaf(x: Any) -> str | None:
    """GLOBAL for a leaf placed on `jdp.mesh()` (replicated, or sharded by ZeRO or as a batch),
    STACKED for a `[local_devices, ...]` leaf (placed by `replicate`, the pmap-layout Loader,
    or returned by pmap), None for anything else."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not x.ndim and sharding.spec:
        return None
    if sharding.spec and sharding.spec[0] == _mesh.LOCAL_AXIS:
        return STACKED
    if sharding.mesh != _mesh.mesh():
        return STACKED if x.ndim and x.shape[0] == jax.local_device_count() else None
    # pmap's outputs on one process sit on this very mesh, split along AXIS; global leaves of
    # a state never are (the state is replicated, ZeRO shards only the optimizer state).
    pmap_output = (sharding.spec and sharding.spec[0] == _mesh.AXIS and jax.process_count() == 1
                   and x.shape[0] == jax.local_device_count())
    return STACKED if pmap_output else GLOBAL


def is_stacked_placement(x: Any) -> bool:
    """Was `x` placed for the pmap layout (`replicate`, the pmap Loader, another process's
    local mesh)? Unlike `layout_of_leaf`, a global batch split along AXIS is never stacked."""
    sharding = getattr(x, "sharding", None)
    return isinstance(sharding, NamedSharding) and bool(x.ndim) and (
        sharding.spec[:1] == (_mesh.LOCAL_AXIS,) or sharding.mesh != _mesh.mesh())


def layout(state: Any) -> str | None:
    """Which layout `state` is in, judged by its params (or first array leaf)."""
    leaves = jax.tree.leaves(getattr(state, "params", state))
    return layout_of_leaf(leaves[0]) if leaves else None
