"""A train state as a checkpoint sees it: its array leaves, each with a name and a logical shape.

ZeRO and FSDP store leaves padded on one axis to a multiple of the device count.
The checkpoint records the logical shape; orbax writes the padded shards as they are and cuts or
zero-fills the padding to the target's shape at restore: 8 devices sharded -> 2 unsharded works,
for a whole state and for FSDP's parameters in any subtree (`state.params`).
"""
from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import numpy as np

from jdp.core import is_sharded, logical_opt_state
from jdp.core import prng_keys as typed_keys


class Leaf(NamedTuple):
    """One array leaf: `shape` is logical (recorded, compared), `physical` as stored here."""
    keys: tuple[str, ...]
    leaf: Any
    shape: tuple[int, ...]
    physical: tuple[int, ...]
    dtype: np.dtype

    @property
    def name(self) -> str:
        return "/".join(self.keys)


def leaves(state: Any, where: str) -> list[Leaf]:
    """The leaves of `state`, in `jax.tree.leaves` order: arrays, and numbers (Python or numpy
    scalars) saved as 0-d arrays; any other leaf (a string, an object) is refused, since
    silently leaving it out would restore the template's value in its place."""
    found = [(p, _array(x, p, where)) for p, x in _flat(state)]
    if not found:
        raise ValueError(f"{where}: the state {type(state).__name__} has no array leaves, so "
                         "there is nothing to checkpoint; pass the train state (from "
                         "jdp.broadcast or jdp.pmap.replicate)")
    logical = _padded_optimizer_leaves(state)
    out = [Leaf(_keys(p), x, logical.get(_keys(p), x.shape), x.shape, np.dtype(x.dtype))
           for p, x in found]
    names = [leaf.name for leaf in out]
    if len(set(names)) != len(names):
        twin = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"{where}: two leaves of the state are both named {twin!r} in a "
                         "checkpoint (a key holding '/', such as 'a/b' beside a "
                         "nested 'a': {'b'}); rename one")
    return out


def _array(x: Any, path: Any, where: str) -> jax.Array | np.ndarray:
    if typed_keys.is_key(x):   # a typed PRNG key (NNX's rngs) is saved as its key data
        return jax.random.key_data(x)
    if isinstance(x, (jax.Array, np.ndarray)):
        return x
    if isinstance(x, (numbers.Number, np.generic)) and np.asarray(x).dtype.kind in "biufc":
        return np.asarray(x)
    raise TypeError(f"{where}: leaf {jax.tree_util.keystr(path) or '<root>'} is a "
                    f"{type(x).__name__} ({str(x)[:40]!r}), which a checkpoint does not hold "
                    "(arrays and numbers only); keep it out of the state (a static field, or "
                    "your own file) or encode it as an array")


def _flat(state: Any) -> list:
    """(path, array) pairs in `jax.tree.leaves` order; an FSDP parameter (`Sharded`) is named
    by its parameter's path, so every layout of a state has the same names."""
    return [(p, x.value if is_sharded(x) else x) for p, x in
            jax.tree_util.tree_flatten_with_path(state, is_leaf=is_sharded)[0]]


def _keys(path: Any) -> tuple[str, ...]:
    """A tree path as the string keys of the nested dict that orbax saves."""
    return tuple(jax.tree_util.keystr((k,), simple=True) for k in path) or ("value",)


def _padded_optimizer_leaves(state: Any) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{keys: logical shape} of leaves stored padded on one axis: FSDP's parameters (`Sharded`,
    wherever they sit: a whole state, `state.params` or any subtree) and ZeRO's and FSDP's
    optimizer state (`tx.init(params)`'s shapes, known from a whole train state)."""
    out = {_keys(path): tuple(x.shape) for path, x in jax.tree_util.tree_flatten_with_path(
        state, is_leaf=is_sharded)[0] if is_sharded(x)}
    try:
        opt_state, logical = state.opt_state, logical_opt_state(state)
    except Exception:  # noqa: BLE001 - not an optax train state we understand: no more padding
        return out
    if jax.tree.structure(logical) != jax.tree.structure(opt_state):
        return out
    stored = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    for (path, x), want in zip(stored, jax.tree.leaves(logical), strict=True):
        shape = tuple(want.shape)
        if shape and x.shape != shape and len(x.shape) == len(shape) and all(
                h >= w for h, w in zip(x.shape, shape, strict=True)):
            out[_keys((jax.tree_util.GetAttrKey("opt_state"), *path))] = shape
    return out


def restored(leaf: Leaf, value: Any) -> Any:
    """A restored value as the template leaf holds it (numpy: with the template's padding)."""
    if not isinstance(leaf.leaf, np.ndarray):
        return value
    value = np.asarray(value)[tuple(slice(0, n) for n in leaf.shape)]
    if leaf.shape == leaf.physical:
        return value
    return np.pad(value, [(0, p - n) for p, n in zip(leaf.physical, leaf.shape, strict=True)])


def rebuild(state: Any, values: list) -> Any:
    """`state` with its leaves, in `leaves()` order, replaced by `values` (a number leaf by a
    number of its own type)."""
    flat, treedef = jax.tree.flatten(state)
    return jax.tree.unflatten(treedef, [_like(x, v) for x, v in zip(flat, values, strict=True)])


def _like(template: Any, value: Any) -> Any:
    if typed_keys.is_key(template):
        return jax.random.wrap_key_data(value, impl=jax.random.key_impl(template))
    if isinstance(template, (jax.Array, np.ndarray)):
        return value
    if isinstance(template, np.generic):
        return np.asarray(value, template.dtype)[()]
    return type(template)(np.asarray(value).item())
