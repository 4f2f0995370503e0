"""A train state as a checkpoint sees it: one logical value per array leaf, and back.

Two layouts reach the Checkpointer. Stacked (`jdp.replicate`, pmap): every leaf
`[local_devices, ...]`, one identical copy per device; its logical value is one copy, on the
host. Global (`jdp.broadcast`): every leaf a global `jax.Array` on `jdp.mesh()`; its logical
value is the array itself, which orbax writes shard by shard (each shard once, by the process
that holds it) and reads back straight into any target sharding. A checkpoint holds logical
values only, so it restores into either layout, on any device or process count.

ZeRO's optimizer state (`jdp.broadcast(state, shard_optimizer=True)`) is stored padded on the
leading axis to a multiple of the device count. The checkpoint records the logical (unpadded)
shape and checksum; orbax writes the padded shards as they are and, at restore, cuts or
zero-fills the padding to the target's shape, so 8 devices sharded -> 2 devices unsharded works.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util
from jax.experimental import multihost_utils

from jdp.core._state import STACKED, layout, unreplicate


class Leaf(NamedTuple):
    """One array leaf of a state: where it sits, its checkpoint name, its logical form.

    `shape` is the logical shape (what is recorded and compared); `physical` the shape of
    one copy as stored in this state (larger on the leading axis for ZeRO's padding).
    """
    path: Any
    keys: tuple[str, ...]
    leaf: Any
    shape: tuple[int, ...]
    physical: tuple[int, ...]
    dtype: np.dtype

    @property
    def name(self) -> str:
        return "/".join(self.keys)


def leaves(state: Any, where: str) -> tuple[list[Leaf], bool]:
    """The array leaves of `state` in its logical form, and whether it is stacked."""
    found = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
             if isinstance(x, (jax.Array, np.ndarray))]
    if not found:
        raise ValueError(f"{where}: the state {type(state).__name__} has no array leaves, so "
                         "there is nothing to checkpoint; pass the train state (from "
                         "jdp.broadcast or jdp.replicate)")
    stacked = _is_stacked(state, found, where)
    logical = {} if stacked else _padded_optimizer_leaves(state)
    out = []
    for p, x in found:
        physical = tuple(x.shape[1:] if stacked else x.shape)
        keys = _keys(p)
        out.append(Leaf(p, keys, x, logical.get(keys, physical), physical, np.dtype(x.dtype)))
    names = [leaf.name for leaf in out]
    if len(set(names)) != len(names):
        twin = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"{where}: two leaves of the state are both named {twin!r} in a "
                         "checkpoint (a key holding '/', such as 'a/b' beside a "
                         "nested 'a': {'b'}); rename one")
    return out, stacked


def _keys(path: Any) -> tuple[str, ...]:
    """A tree path as the string keys of the nested dict that orbax saves."""
    return tuple(jax.tree_util.keystr((k,), simple=True) for k in path) or ("value",)


def _padded_optimizer_leaves(state: Any) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{keys: logical shape} of optimizer-state leaves stored padded on their leading axis.

    ZeRO (`jdp.broadcast(state, shard_optimizer=True)`) pads each optimizer-state leaf to a
    multiple of the device count; the logical leaf is what `tx.init(params)` makes. The
    checkpoint records and compares logical shapes, so it restores onto any device count.
    """
    if not all(hasattr(state, a) for a in ("tx", "params", "opt_state")):
        return {}
    try:
        logical = jax.eval_shape(state.tx.init, state.params)
    except Exception:  # noqa: BLE001 - not an optax state we understand: no padding assumed
        return {}
    stored = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
    if jax.tree.structure(logical) != jax.tree.structure(state.opt_state):
        return {}
    out = {}
    for (path, x), want in zip(stored, jax.tree.leaves(logical), strict=True):
        shape = tuple(want.shape)
        if shape and tuple(x.shape) != shape and x.shape[1:] == shape[1:] \
                and x.shape[0] > shape[0]:
            out[_keys((jax.tree_util.GetAttrKey("opt_state"), *path))] = shape
    return out


def crop(value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The logical part of a (possibly padded) host value."""
    return value[tuple(slice(0, n) for n in shape)]


def _is_stacked(state: Any, found: list, where: str) -> bool:
    """Whether `state` is in the stacked layout (jdp's own judgement, `jdp.state.layout`);
    then every array leaf must carry one copy per local device."""
    if layout(state) != STACKED:
        return False
    n = jax.local_device_count()
    for path, x in found:
        if np.ndim(x) == 0 or x.shape[0] != n:
            raise ValueError(
                f"{where}: the state is in the stacked layout (jdp.replicate) but leaf "
                f"{'/'.join(_keys(path))} has shape {np.shape(x)}, not [{n}, ...]; pass the "
                "whole state through jdp.replicate (or jdp.broadcast for the global layout)")
    return True


def saved_value(leaf: Leaf, stacked: bool) -> Any:
    """What is saved for a leaf: device 0's copy (stacked), or the global array itself, ZeRO's
    padded rows included (orbax writes each shard once; the record holds the logical shape)."""
    if stacked:
        # A host copy, not a view: a later donated step may reuse the device buffer.
        return np.array(unreplicate(leaf.leaf))
    return leaf.leaf


def host_value(value: Any) -> np.ndarray:
    """The whole logical value on the host (for checksums); a collective if it is sharded
    over processes, so every process calls it for the same leaves in the same order."""
    if isinstance(value, np.ndarray):
        return value
    if value.is_fully_addressable:
        return np.asarray(value)
    if value.sharding.is_fully_replicated:
        return np.asarray(value.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def saved_tree(items: dict[tuple[str, ...], Any]) -> dict:
    """{keys: value} as the nested dict orbax saves and restores."""
    return traverse_util.unflatten_dict(items)


def saved_flat(nested: dict) -> dict[tuple[str, ...], Any]:
    """The nested dict orbax restored as {keys: value}."""
    return traverse_util.flatten_dict(nested)


def target(leaf: Leaf, stacked: bool) -> tuple[Any, ocp.RestoreArgs]:
    """What orbax restores a leaf as: host numpy, or a global array with the leaf's sharding
    and physical shape (strict=False: ZeRO padding is cut off or zero-filled as needed)."""
    if stacked or isinstance(leaf.leaf, np.ndarray):
        # A zero-byte view of the right shape and dtype: orbax reads it as "numpy, please".
        return (np.broadcast_to(np.empty((), leaf.dtype), leaf.physical),
                ocp.RestoreArgs(restore_type=np.ndarray))
    sharding = leaf.leaf.sharding
    return (jax.ShapeDtypeStruct(leaf.physical, leaf.dtype, sharding=sharding),
            ocp.ArrayRestoreArgs(sharding=sharding, global_shape=leaf.physical, strict=False))


def place(value: Any, leaf: Leaf, stacked: bool) -> Any:
    """A restored value laid out like the template leaf."""
    if isinstance(value, np.ndarray) and value.shape != leaf.physical:  # ZeRO padding
        value = np.pad(crop(value, leaf.shape),
                       [(0, p - n) for p, n in zip(leaf.physical, leaf.shape, strict=True)])
    if stacked:
        copies = np.broadcast_to(value, leaf.leaf.shape)
        if isinstance(leaf.leaf, np.ndarray):
            return copies.copy()
        return jax.device_put(copies, leaf.leaf.sharding)
    return np.array(value) if isinstance(leaf.leaf, np.ndarray) else value


def rebuild(state: Any, values: list) -> Any:
    """`state` with its array leaves, in `leaves()` order, replaced by `values`."""
    flat, treedef = jax.tree.flatten(state)
    given = iter(values)
    return jax.tree.unflatten(treedef, [next(given) if isinstance(x, (jax.Array, np.ndarray))
                                        else x for x in flat])
