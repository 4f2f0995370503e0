"""Train state across devices: one copy per local device (`replicate`) and back.

A data-parallel step needs the same parameters on every device of every process. Arrays carry a
leading device axis of size `jax.local_device_count()`, as `jax.pmap` expects.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax.training import train_state

from jdp._mesh import local_sharding
from jdp.distributed import broadcast_from_primary


class TrainState(train_state.TrainState):
    """flax's TrainState plus the model's non-trained state and an RNG key.

    `model_state` holds what the forward pass updates but the optimiser does not (flax
    `batch_stats`, an NNX `BatchStat` state); `jdp.train_step` hands it to the loss and keeps
    it in sync across devices. `rng` is a raw `uint32[2]` key: each step derives a key per
    device and per step from it, so dropout differs across devices and reruns reproduce.

    Example:
        >>> state = jdp.TrainState.create(apply_fn=model.apply, params=v["params"],
        ...     tx=optax.sgd(0.1), model_state=v["batch_stats"], seed=0)
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


def replicate(tree: Any) -> Any:
    """Put one copy of every leaf of `tree` on each local device.

    Leaves gain a leading axis of size `jax.local_device_count()`. On a multi-process run every
    process ends up with process 0's values, as DDP broadcasts rank 0's parameters at
    construction, so replicas start identical even if processes were seeded differently.

    Args:
        tree: a pytree of arrays (a TrainState, params, ...), one copy, not replicated.

    Returns:
        The same structure with `jax.Array` leaves sharded over the local devices.

    Example:
        >>> state = jdp.replicate(state)   # params: [8, ...] on 8 devices
    """
    tree = broadcast_from_primary(tree)
    sharding = local_sharding()
    n = len(sharding.device_set)
    return jax.tree.map(
        lambda x: jax.device_put(np.broadcast_to(x, (n, *np.shape(x))), sharding), tree)


def unreplicate(tree: Any) -> Any:
    """Take the first device's copy of every leaf of a replicated `tree`.

    Example:
        >>> params = jdp.unreplicate(state).params
        >>> loss = float(jdp.unreplicate(metrics)["loss"])
    """
    def first(x):
        if isinstance(x, jax.Array) and x.ndim and x.is_fully_addressable:
            return x.addressable_data(0)[0] if x.addressable_data(0).shape[0] == 1 else x[0]
        return x[0]

    return jax.tree.map(first, tree)


def shard(tree: Any) -> Any:
    """Split each leaf's leading axis over the local devices: `[n*b, ...] -> [n, b, ...]`.

    Use it to feed a batch held by this process to a jdp step without the Loader.

    Raises:
        ValueError: a leaf's leading axis is not divisible by the local device count.

    Example:
        >>> host_batch = jdp.shard({"x": x, "y": y})   # x: [64, 2] -> [8, 8, 2] on 8 devices
    """
    n = jax.local_device_count()

    def split(path, x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if x.ndim == 0 or x.shape[0] % n:
            raise ValueError(
                f"jdp.shard: leaf {jax.tree_util.keystr(path) or 'batch'} has shape {x.shape}; "
                f"its leading axis must be divisible by the {n} local devices: pick a batch size "
                f"that is a multiple of {n}")
        return x.reshape(n, x.shape[0] // n, *x.shape[1:])

    return jax.tree_util.tree_map_with_path(split, tree)
