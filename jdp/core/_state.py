"""The train state as global arrays, and the TrainState that carries it.

`broadcast` makes every array leaf one global `jax.Array` on `jdp.mesh()`, holding process 0's
values: replicated, or with the optimizer state sharded (ZeRO). `state.params` is the
parameters and `jax.device_get(state)` one copy. `shard` makes a process's rows its part of a
global batch; `unshard` gives a ZeRO state back with every leaf whole and replicated.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax.training import train_state

from jdp.core import _inflight, _mesh, _zero
from jdp.distributed import _group


class TrainState(train_state.TrainState):
    """flax's TrainState plus the model's non-trained state and an RNG key.

    `model_state` holds what the forward pass updates but the optimiser does not (flax
    `batch_stats`, an NNX `BatchStat` state); `jdp.train_step` hands it to the loss and keeps
    it in sync across devices. `rng` is a raw `uint32[2]` key: each step derives a key per
    device and per step from it, so dropout differs across devices and reruns reproduce.

    Example:
        >>> import jdp, optax
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


def broadcast(tree: Any, *, shard_optimizer: bool = False, shard_params: bool = False) -> Any:
    """Place `tree` on every device of every process as global arrays.

    Each array leaf becomes a `jax.Array` fully replicated on `jdp.mesh()`
    (`NamedSharding(mesh, P())`) holding process 0's values, so replicas start identical even
    if processes were seeded differently. There is no device axis: `state.params` is the
    parameters and `float(metrics["loss"])` works.

    Args:
        tree: a pytree of arrays (a TrainState, params, ...), one copy.
        shard_optimizer: ZeRO-1/2: place the optimiser state (`tree.opt_state`) sharded along
            `jdp.AXIS` instead, each device holding 1/N of it (leaves padded on their leading
            axis to a multiple of N; scalars replicated); it never exists whole on a device.
            Use it with `jdp.train_step(..., shard_optimizer=True)`.
        shard_params: FSDP / ZeRO-3: the parameters sharded too (and the optimizer state):
            each parameter leaf with a leading axis becomes a `Sharded` node holding 1/N of its
            padded rows per device. Use it with `jdp.train_step(..., shard_params=True)`;
            `jdp.unshard(state)` gives the parameters back in the model's own shapes.

    Returns:
        The same structure with global `jax.Array` leaves.

    Example:
        >>> import jdp
        >>> state = jdp.broadcast({"w": np.ones(3)})
        >>> state["w"].sharding.is_fully_replicated, state["w"].shape
        (True, (3,))
    """
    from jdp import pmap  # the one question about the other form; jdp.pmap imports this module
    if pmap.is_stacked(tree):
        raise ValueError("jdp.broadcast: the state is in the pmap form (jdp.replicate): pass "
                         "jdp.pmap.unreplicate(state), or keep the pmap form and use "
                         "jdp.pmap.train_step")
    host = _group.broadcast(tree, "jdp.broadcast")
    placed = jax.tree.map(lambda x: _mesh.place(x, _mesh.replicated()), host)
    if not (shard_optimizer or shard_params):
        return placed
    missing = [f for f in ("opt_state", "params") if not hasattr(host, f)]
    if missing:
        option = "shard_params" if shard_params else "shard_optimizer"
        raise TypeError(f"jdp.broadcast({option}=True): {type(tree).__name__} has no "
                        f"{missing[0]} field; pass the TrainState (jdp.TrainState or flax's)")
    placed = placed.replace(
        opt_state=jax.tree.map(lambda x: _mesh.place(*_zero.sharded_host(x)), host.opt_state))
    return placed.replace(params=_zero.shard_params_host(host.params)) if shard_params else placed


def shard(rows: Any, *, layout: str = "global") -> Any:
    """Make this process's rows of a batch its part of one global batch, without the Loader.

    Each leaf `[local_devices*b, ...]` becomes a global array `[all_devices*b, ...]` split along
    `jdp.AXIS`, this process's rows on its own devices (one process: the rows themselves).
    `layout="pmap"` is the classic form's alias for `jdp.pmap.shard(rows)`.

    Raises:
        ValueError: a leaf's leading axis is not divisible by the local device count.

    Example:
        >>> import jdp
        >>> n = jax.local_device_count()
        >>> batch = jdp.shard({"x": np.zeros((2 * n, 3))})
        >>> batch["x"].shape == (2 * n * jax.process_count(), 3)
        True
    """
    if layout == "pmap":
        from jdp import pmap  # the classic form's alias; jdp.pmap imports this module
        return pmap.shard(rows)
    if layout != "global":
        raise ValueError(f"jdp.shard: layout={layout!r}; expected 'global' (default) or 'pmap'")
    _group.require_job("jdp.shard")
    batch = _mesh.place_rows(divisible_rows(rows, "jdp.shard"))
    _SHARDED.handed(batch, count=False)   # the user's own step: seen and bounded in flight
    return batch


_SHARDED = _inflight.Window()   # jdp.shard's recent batches (one per field when called per field)


def divisible_rows(rows: Any, who: str) -> Any:
    """`rows` as arrays whose leading axis the local devices divide, or a ValueError."""
    n = jax.local_device_count()

    def check(path, x):
        x = x if isinstance(x, jax.Array) else np.asarray(x)
        if x.ndim == 0 or x.shape[0] % n:
            raise ValueError(
                f"{who}: leaf {jax.tree_util.keystr(path) or 'batch'} has shape {x.shape}; "
                f"its leading axis must be divisible by the {n} local devices: pick a batch size "
                f"that is a multiple of {n}")
        return x

    return jax.tree_util.tree_map_with_path(check, rows)


def unshard(state: Any) -> Any:
    """The state with every leaf whole and replicated on `jdp.mesh()`, in the model's shapes.

    A ZeRO or FSDP state (`broadcast(state, shard_optimizer=True)` or `shard_params=True`)
    gets its parameters and optimizer state back unpadded; a replicated state comes back as
    it is. For export and inspection.

    Example:
        >>> import jdp, optax
        >>> state = jdp.TrainState.create(apply_fn=None, params={"w": np.ones(3)},
        ...                               tx=optax.adam(0.1))
        >>> fsdp = jdp.broadcast(state, shard_params=True)
        >>> full = jdp.unshard(fsdp)
        >>> full.params["w"].shape, full.opt_state[0].mu["w"].shape
        ((3,), (3,))
    """
    opt_state = getattr(state, "opt_state", None)
    if opt_state is None or getattr(state, "tx", None) is None:
        return state
    logical = _zero.logical_opt_state(state)
    if not _zero.is_stored(opt_state, logical):
        return state
    params = state.params
    if any(_zero.is_sharded(x) for x in jax.tree.leaves(params, is_leaf=_zero.is_sharded)):
        params = jax.jit(_zero.logical, out_shardings=_mesh.replicated())(params)
    return state.replace(params=params, opt_state=_zero.gathered(opt_state, logical))
