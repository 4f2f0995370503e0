"""The train state as global arrays, and the TrainState that carries it.

`broadcast` makes every array leaf one global `jax.Array` on `jdp.mesh()`, holding process 0's
values: replicated, or with the optimizer state sharded (ZeRO). `state.params` is the
parameters and `jax.device_get(state)` one copy. `shard` makes a process's rows its part of a
global batch; `unshard` gives a ZeRO or FSDP state (or its parameters) back with every leaf whole
and replicated.
"""
from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np
from flax.training import train_state

from jdp.core import _inflight, _options, forms, layouts, prng_keys
from jdp.distributed import agree, agree_once, broadcast_for, require_job
from jdp.job import rank as _rank
from jdp.spmd import mesh as _mesh
from jdp.spmd import storage as _storage


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


def broadcast(tree: Any, *, shard_optimizer: bool = False,
              shard_params: bool | int | str = False) -> Any:
    """Place `tree` on every device of every process as global arrays.

    Each array leaf becomes a `jax.Array` fully replicated on `jdp.mesh()`
    (`NamedSharding(mesh, P())`) holding process 0's values, so replicas start identical even
    if processes were seeded differently. There is no device axis: `state.params` is the
    parameters and `float(metrics["loss"])` works.

    Args:
        tree: a pytree of arrays (a TrainState, params, ...), one copy.
        shard_optimizer: ZeRO-1/2: place the optimiser state (`tree.opt_state`) split along
            `jdp.AXIS` instead, each device holding 1/N of each leaf on the largest axis N
            divides (leaves with none, scalars and non-float leaves such as a PRNG key stay
            whole); it never exists whole on a device.
            Use it with `jdp.train_step(..., shard_optimizer=True)`.
        shard_params: FSDP / ZeRO-3: the parameters split the same way (and the optimizer
            state): each stays a `jax.Array` of the model's own shape and dtype, 1/N of it per
            device, so any JAX, flax, optax or orbax function works on it (a function outside
            the step that uses a whole parameter gathers it there). A stacked leaf of 3 or
            more dimensions is not split on its leading axis, so a scanned model is gathered
            one layer at a time. Use it with `jdp.train_step(..., shard_params=True)`;
            `jdp.unshard(state)` gives every leaf whole and replicated. HSDP: an int k splits
            within groups of k consecutive devices and replicates across the groups; "node"
            within each node's devices (this process's devices x the processes per node, as
            the engine says: `jdp.distributed.processes_per_node`); the step takes the same
            value.

    Returns:
        The same structure with global `jax.Array` leaves.

    Example:
        >>> import jdp
        >>> state = jdp.broadcast({"w": np.ones(3)})
        >>> state["w"].sharding.is_fully_replicated, state["w"].shape
        (True, (3,))
    """
    shard_optimizer = _options.bool_options("jdp.broadcast",
                                           shard_optimizer=shard_optimizer)["shard_optimizer"]
    shard_params = _options.shard_params_option(shard_params, who="jdp.broadcast")
    other = layouts.of(tree, "jdp.broadcast")
    if other is not None:
        raise ValueError(f"jdp.broadcast: the state is in the {other.name} form "
                         f"({other.made_by}): pass {other.undone_by}(state), or keep the "
                         f"{other.name} form and use {other.step}")
    tree, keys = prng_keys.unwrap(tree)   # typed PRNG keys travel as their key data
    host = broadcast_for(tree, "jdp.broadcast")
    return prng_keys.wrap(_placed(host, shard_optimizer, shard_params), keys)


def _placed(host: Any, shard_optimizer: bool, shard_params: bool) -> Any:
    """`broadcast`'s placement of the host values every process now holds."""
    placed = jax.tree.map(lambda x: _mesh.place(x, _mesh.replicated()), host)
    if not (shard_optimizer or shard_params):
        return placed
    missing = [f for f in ("opt_state", "params") if not hasattr(host, f)]
    if missing:
        option = f"shard_params={shard_params!r}" if shard_params else "shard_optimizer=True"
        raise TypeError(f"jdp.broadcast({option}): {type(host).__name__} has no "
                        f"{missing[0]} field; pass the TrainState (jdp.TrainState or flax's)")
    group = _options.group_size(shard_params) if shard_params else None
    placed = placed.replace(opt_state=_storage.place_split(host.opt_state, group,
                                                         bool(shard_params)))
    if not shard_params:
        return placed
    _say_whole(host.params, group, shard_params)
    return placed.replace(params=_storage.place_split(host.params, group))


WHOLE_SAID = (0.01, 2**20)   # kept-whole parameters under this share or bytes: not worth a word


def _say_whole(params: Any, group: int | None, option: Any) -> None:
    """Warn when parameters that no axis of the device count divides, kept whole on every
    device, hold a noticeable share of the model and a MiB or more (a bias of 10 classes
    does not)."""
    whole = _storage.whole_leaves(params, group)
    total = sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(params))
    kept = sum(size for _, size in whole)
    if kept <= WHOLE_SAID[0] * total or kept < WHOLE_SAID[1]:
        return
    names = ", ".join(name for name, _ in whole[:3]) + (", ..." if len(whole) > 3 else "")
    warnings.warn(
        f"jdp.broadcast(shard_params={option!r}): {len(whole)} parameter(s) ({names}: "
        f"{kept / 2**20:.1f} MiB, {100 * kept / total:.0f} % of the parameters) have no axis "
        f"the {_storage.ways(group)} devices divide, so each device keeps them whole; widths "
        f"that {_storage.ways(group)} divides split them", UserWarning, stacklevel=3)


def shard(rows: Any, *, layout: str = "global") -> Any:
    """Make this process's rows of a batch its part of one global batch, without the Loader.

    Each leaf `[local_devices*b, ...]` becomes a global array `[all_devices*b, ...]` split along
    `jdp.AXIS`, this process's rows on its own devices (one process: the rows themselves).
    `layout="pmap"` is the classic form's alias for `jdp.pmap.shard(rows)`.

    Raises:
        ValueError: a leaf's leading axis is not divisible by the local device count; or (on
            every process) the processes' rows differ in count, dtype or shape, which would
            give each its own idea of the global batch (asked once per new signature).

    Example:
        >>> import jdp
        >>> n = jax.local_device_count()
        >>> batch = jdp.shard({"x": np.zeros((2 * n, 3))})
        >>> batch["x"].shape == (2 * n * jax.process_count(), 3)
        True
    """
    if layout != layouts.GLOBAL:
        return _adapter(layout).shard(rows)
    require_job("jdp.shard")
    batch = _mesh.place_rows(divisible_rows(rows, "jdp.shard"))
    rank = _rank.current()
    agree_once(rank.agreement.shard_signatures, "shard", batch, "jdp.shard",
               "every process must pass the same number of rows, of the same dtypes "
               "and shapes (rows per process = global batch / processes)")
    if rank.in_flight.shard_window is None:   # jdp.shard's recent batches, one per field
        rank.in_flight.shard_window = _inflight.StepWindow()
    rank.in_flight.shard_window.handed(batch, count=False)   # the user's own step: bounded
    return batch


def _adapter(layout: Any) -> layouts.Layout:
    """The registered layout called `layout` (one an adapter such as jdp.pmap plugged in)."""
    try:
        return layouts.named(layout)
    except ValueError:
        raise ValueError(f"jdp.shard: layout={layout!r}; expected 'global' (default) or "
                         f"{' or '.join(map(repr, layouts.names()[1:]))}") from None


def divisible_rows(rows: Any, who: str) -> Any:
    """`rows` as arrays whose leading axis the local devices divide, or a ValueError."""
    n = jax.local_device_count()

    def check(path, x):
        x = x if isinstance(x, jax.Array) else np.asarray(x)
        if x.ndim == 0 or x.shape[0] % n:
            rows = "no rows (a scalar)" if x.ndim == 0 else f"{x.shape[0]} rows"
            raise ValueError(
                f"{who}: leaf {jax.tree_util.keystr(path) or 'batch'} has {rows}, which the "
                f"{n} local devices cannot split evenly: pass a multiple of {n} rows per "
                "process (the leading axis is the rows)")
        return x

    return jax.tree_util.tree_map_with_path(check, rows)


def unshard(tree: Any) -> Any:
    """`tree` with every leaf whole and replicated on `jdp.mesh()`, in the model's shapes.

    Every leaf stored split (ZeRO's optimizer state, FSDP's parameters and theirs, any
    subtree of them: they keep the model's shapes) is gathered; the rest comes back as it is.
    For export, and for a host that wants every value in its own memory: arrays split over
    several processes cannot be read whole on one (`np.asarray`) until gathered. A
    collective, so every process calls it; it is announced first, so a process that skips it
    is named on every process within seconds.

    Example:
        >>> import jdp, optax
        >>> state = jdp.TrainState.create(apply_fn=None, params={"w": np.ones(3)},
        ...                               tx=optax.adam(0.1))
        >>> fsdp = jdp.broadcast(state, shard_params=True)
        >>> full = jdp.unshard(fsdp)
        >>> full.params["w"].shape, full.opt_state[0].mu["w"].shape
        ((3,), (3,))
        >>> jdp.unshard(fsdp.params)["w"].sharding.is_fully_replicated
        True
    """
    if forms.tree_form(tree, "jdp.unshard") == forms.PMAP:
        raise ValueError("jdp.unshard: the state is in the pmap form (placed by jdp.pmap), "
                         "whose leaves are whole already: jdp.pmap.unreplicate(state) gives "
                         "one copy")
    _announce_unshard(tree)
    return _whole(tree)


def _announce_unshard(tree: Any) -> None:
    """Every process gathers the same tree: an agreement point before the gathers, so a
    process that skips `unshard` (or passes another tree) is named on every process instead
    of leaving the others in a gather forever."""
    if jax.process_count() == 1:
        return
    require_job("jdp.unshard")
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    facts = [(jax.tree_util.keystr(path) or "<root>",
              f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}")
             for path, x in flat]
    agree("unshard", facts, "jdp.unshard", "every process must call jdp.unshard on the same "
          "tree (it gathers the shards every process holds)")


def _split(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.sharding.is_fully_replicated


def _whole(tree: Any) -> Any:
    """`tree` with its split leaves gathered whole and replicated; the rest as they are."""
    leaves, treedef = jax.tree.flatten(tree)
    split = [i for i, x in enumerate(leaves) if _split(x)]
    if not split:
        return tree
    gathered = jax.jit(lambda xs: xs, out_shardings=_mesh.replicated())([leaves[i] for i in split])
    for i, x in zip(split, gathered, strict=True):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)
