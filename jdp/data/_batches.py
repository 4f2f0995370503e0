"""Building one host batch: read rows, transform (with replayable per-example randomness), check.

This is the part of the Loader that runs in worker processes when `num_workers > 0`, so it
takes only picklable values and no Loader: a `Recipe` (how to read and transform, fixed for
the Loader's life, sent to each worker once) and an `EpochPlan` (which rows batch b holds,
sent once per pass over an epoch).

Augmentation that replays: a transform with a parameter named `rng` is called as
`transform(batch, rng=rngs)`, where `rngs[j]` is a `numpy.random.Generator` seeded by
`(seed, epoch, example index of row j)`. An example therefore gets the same random numbers in
a given epoch whatever the batch it lands in, the worker count, the process count or the
resume point, and different ones in the next epoch.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jdp.data import _sources


class Recipe(NamedTuple):
    """How to turn example indices into a host batch (fixed for a Loader's life)."""
    read: _sources.Reader
    transform: Callable[..., dict] | None
    augment: bool  # transform takes `rng=`


class EpochPlan(NamedTuple):
    """Which examples batch b of this pass holds: rows [b * size, (b + 1) * size)."""
    indices: np.ndarray
    real: np.ndarray
    batch_size: int
    seed: int
    epoch: int


def wants_rng(transform: Callable | None) -> bool:
    """Whether `transform` takes the per-example generators (a parameter named `rng`)."""
    if transform is None:
        return False
    try:
        return "rng" in inspect.signature(transform).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False


def example_rngs(seed: int, epoch: int, indices: np.ndarray) -> list[np.random.Generator]:
    """One generator per row, seeded by (seed, epoch, example index): the replayable draw."""
    return [np.random.default_rng([seed, epoch, int(i)]) for i in indices]


def rows(plan: EpochPlan, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Example indices and real-row mask of batch b, the last partial batch filled by repeats."""
    size = plan.batch_size
    idx = plan.indices[b * size:(b + 1) * size]
    real = plan.real[b * size:(b + 1) * size]
    if len(idx) < size:  # last partial batch: fill with repeats of its rows, masked out
        real = np.concatenate([real, np.zeros(size - len(idx), bool)])
        idx = np.resize(idx, size)
    return idx, real


def host_batch(recipe: Recipe, plan: EpochPlan, b: int) -> dict:
    """Batch b as host numpy arrays `[batch_size, ...]`, `"mask"` included."""
    idx, real = rows(plan, b)
    fields = recipe.read(idx)
    if recipe.augment:
        fields = recipe.transform(fields, rng=example_rngs(plan.seed, plan.epoch, idx))
        fields = check_transformed(fields, plan.batch_size)
    elif recipe.transform is not None:
        fields = check_transformed(recipe.transform(fields), plan.batch_size)
    check_dtypes(fields)
    return {**fields, _sources.MASK: real}


def check_transformed(fields: Any, size: int) -> dict:
    """The transform's output is a dict of arrays with one row per example and no "mask"."""
    if not isinstance(fields, Mapping):
        raise TypeError(f"Loader: transform returned a {type(fields).__name__}; expected the "
                        "batch dict (transform(batch) -> batch)")
    if _sources.MASK in fields:
        raise ValueError(f"Loader: transform returned a field named {_sources.MASK!r}, which "
                         "the Loader adds itself; rename it")
    for path, leaf in jax.tree_util.tree_flatten_with_path(dict(fields))[0]:
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] != size:
            raise ValueError(f"Loader: transform returned {jax.tree_util.keystr(path)} with "
                             f"shape {np.shape(leaf)}; expected a leading axis of batch_size="
                             f"{size} (one row per example, padding rows included)")
    return dict(fields)


def check_dtypes(fields: Mapping) -> None:
    """Every leaf can go on a device: no strings, bytes or Python objects."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(dict(fields))[0]:
        dtype = np.asarray(leaf).dtype
        if dtype.kind in "USOV":
            raise TypeError(f"Loader: field {jax.tree_util.keystr(path)} has dtype {dtype} "
                            "(strings or objects), which cannot go on a device; drop it, or "
                            "turn it into numbers in transform=")
