"""Typed PRNG keys in a state (an NNX module's `nnx.Rngs` / `nnx.Dropout` streams): carried as
their raw key data wherever jdp moves bytes, and wrapped back as keys of their own kind.

A typed key (`jax.random.key`, dtype `key<fry>`) cannot become a NumPy array, so the host
broadcast, the placement and the checkpoint take `jax.random.key_data` (uint32, one trailing
axis more) and `jax.random.wrap_key_data(..., impl=)` gives the key back on the same devices.
"""
from __future__ import annotations

from typing import Any

import jax


def is_key(x: Any) -> bool:
    """A typed PRNG key array (not a raw uint32 key)."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def unwrap(tree: Any) -> tuple[Any, dict]:
    """`tree` with each typed key leaf replaced by its key data, and {path: impl} to wrap back."""
    impls = {}

    def data(path, x):
        if not is_key(x):
            return x
        impls[path] = jax.random.key_impl(x)
        return jax.random.key_data(x)

    return jax.tree_util.tree_map_with_path(data, tree), impls


def wrap(tree: Any, impls: dict) -> Any:
    """`unwrap`'s inverse: the leaves at `impls`' paths wrapped as keys of their kind."""
    if not impls:
        return tree
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.random.wrap_key_data(x, impl=impls[path]) if path in impls else x,
        tree)
