"""A train state as a checkpoint sees it: its array leaves, each with a name and a shape.

ZeRO and FSDP keep every leaf in its own shape (split, never padded), so a checkpoint holds the
same arrays whatever the layout and device count: 8 devices sharded -> 2 unsharded works. A
checkpoint written by jdp 0.7 or earlier holds some leaves padded on one axis; orbax cuts them
to the template's shape at restore (`strict=False`), and a host template's value is cut here.
"""
from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import numpy as np

from jdp.core import prng_keys as typed_keys


class Leaf(NamedTuple):
    """One array leaf: its keys in the saved nested dict, the template's leaf, shape, dtype."""
    keys: tuple[str, ...]
    leaf: Any
    shape: tuple[int, ...]
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
    out = [Leaf(_keys(p), x, tuple(x.shape), np.dtype(x.dtype)) for p, x in found]
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
    """(path, leaf) pairs in `jax.tree.leaves` order."""
    return jax.tree_util.tree_flatten_with_path(state)[0]


def _keys(path: Any) -> tuple[str, ...]:
    """A tree path as the string keys of the nested dict that orbax saves."""
    return tuple(jax.tree_util.keystr((k,), simple=True) for k in path) or ("value",)


def restored(leaf: Leaf, value: Any) -> Any:
    """A restored value as the template leaf holds it (numpy: cut to its shape, as a
    checkpoint of jdp 0.7 or earlier may hold it padded)."""
    if not isinstance(leaf.leaf, np.ndarray):
        return value
    return np.asarray(value)[tuple(slice(0, n) for n in leaf.shape)]


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
