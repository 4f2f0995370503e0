"""Host batches: reading a batch of examples from a source, transforming it, checking it.

An `ArraySource` (or a dict of arrays) is read by numpy fancy indexing; any other source by
`source.__getitems__(indices)` where it exists, else `source[i]` per example, then stacked.

This is the part of the Loader that runs in worker processes, so it takes only picklable
values: a `Recipe` (how to read and transform, fixed for the Loader's life) and an `EpochPlan`
(which rows batch b holds in one pass over an epoch). A transform with a parameter named `rng`
gets one `numpy.random.Generator` per row seeded by (seed, epoch, example index): an example's
augmentation replays whatever the batch it lands in, the worker or process count or the
resume point, and differs in the next epoch.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

Reader = Callable[[np.ndarray], dict]  # read(indices) -> {field: [len(indices), ...] array}
MASK = "mask"  # the field the Loader adds; a source may not use it


def make_reader(source: Any) -> tuple[int, Reader]:
    """Number of examples in `source` and a function reading rows `indices` of it."""
    if isinstance(source, Mapping):
        source = ArraySource(source)
    if isinstance(source, ArraySource):
        return len(source), source.read
    if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        return len(source), _ExampleReader(source)
    raise TypeError(
        f"Loader: source of type {type(source).__name__} is not readable; expected a dict of "
        "arrays ({'image': x, 'label': y}) or an object with __len__ and __getitem__ returning "
        "a dict of fields (e.g. tfds.data_source(...)): wrap your data as one of those")


class ArraySource:
    """Examples held as a dict of arrays, one row per example: the Loader's fast path.

    `source[i]` is example i as a dict, as for any random-access source, but the Loader reads
    whole batches by numpy fancy indexing. A dict of arrays passed to the Loader is wrapped.

    Args:
        arrays: field name -> array (numpy or anything `np.asarray` takes), all of the same
            length; no field may be called "mask".

    Raises:
        ValueError: no fields, a field that is not an array, or fields of different lengths.

    Example:
        >>> source = ArraySource({"x": np.zeros((100, 3)), "y": np.arange(100)})
        >>> len(source), int(source[7]["y"]), source.arrays["x"].shape
        (100, 7, (100, 3))
    """

    def __init__(self, arrays: Mapping[str, Any]):
        if not arrays:
            raise ValueError("ArraySource: no fields; pass a dict such as {'x': x, 'y': y}")
        self.arrays = {key: np.asarray(value) for key, value in arrays.items()}
        flat = [key for key, a in self.arrays.items() if a.ndim == 0]
        if flat:
            raise ValueError(f"ArraySource: field(s) {flat} are not arrays with one row per "
                             "example (got a scalar or a nested dict); pass a flat dict of arrays")
        _check_no_mask(self.arrays, "the source dict")
        lengths = {key: len(a) for key, a in self.arrays.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"ArraySource: fields have different lengths {lengths}; every "
                             "field must hold one row per example (same leading axis)")
        self._len = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict:
        return {key: a[index] for key, a in self.arrays.items()}

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        return [self[i] for i in indices]

    def read(self, indices: np.ndarray) -> dict:
        """Rows `indices` of every field (`{field: array[len(indices), ...]}`)."""
        return {key: a[indices] for key, a in self.arrays.items()}

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}: {a.dtype}{list(a.shape[1:])}" for k, a in self.arrays.items())
        return f"ArraySource({self._len} examples; {fields})"


class _ExampleReader:
    """Reads a batch from a random-access source of dict examples and stacks each field."""

    def __init__(self, source: Any):
        self.source = source
        # tfds's DataSource forwards __getitems__ to its `.data_source`: check that one too.
        inner = getattr(source, "data_source", None)
        self.batched = _takes_one_argument(getattr(source, "__getitems__", None)) and (
            inner is None or not hasattr(inner, "__getitems__")
            or _takes_one_argument(inner.__getitems__))

    def __call__(self, idx: np.ndarray) -> dict:
        keys = idx.tolist()
        examples = self._examples(keys)
        if len(examples) != len(keys):
            raise ValueError(f"Loader: the source returned {len(examples)} examples for "
                             f"{len(keys)} indices; __getitems__ must return one per index")
        return _stack(examples, keys)

    def _examples(self, keys: list[int]) -> Sequence:
        if not self.batched:
            return [self._one(k) for k in keys]
        try:
            return list(self.source.__getitems__(keys))
        except Exception as err:
            for k in keys:  # which example fails on its own? Name it.
                self._one(k)
            raise ReadError(f"Loader: source.__getitems__ failed for example indices "
                            f"{shown(keys)} ({type(err).__name__}: {err}), though each reads "
                            "alone with source[i]; fix __getitems__ (the cause is chained)"
                            ) from err

    def _one(self, k: int) -> Any:
        try:
            return self.source[k]
        except Exception as err:
            raise ReadError(f"Loader: reading example index {k} failed: source[{k}] raised "
                            f"{type(err).__name__}: {err}; fix the source or that example (the "
                            "cause is chained)") from err


class ReadError(RuntimeError):
    """Reading an example from a source failed; the message names the example index."""


def _takes_one_argument(getitems: Any) -> bool:
    """Whether `getitems(keys)` can be called: False for a missing or unbound `__getitems__`.

    tfds.testing.mock_data's `__getitems__` is an unbound `functools.partial` of (self, keys):
    such a source is read one example at a time.
    """
    if not callable(getitems):
        return False
    try:
        inspect.signature(getitems).bind([0])
    except TypeError:
        return False
    except ValueError:  # no signature to inspect (a builtin): assume it takes the keys
        return True
    return True


def shown(keys: list[int]) -> str:
    """The first 8 of `keys`, for error messages."""
    return f"{keys[:8]}{'...' if len(keys) > 8 else ''}"


def _stack(examples: Sequence, keys: list[int]) -> dict:
    first = examples[0]
    if not isinstance(first, Mapping):
        raise TypeError(f"Loader: source[{keys[0]}] is a {type(first).__name__}; expected a dict "
                        "of fields such as {'image': ..., 'label': ...}: make __getitem__ "
                        "return a dict")
    _check_no_mask(first, f"source[{keys[0]}]")
    _same_fields(examples, keys)
    stacked = {}
    for field in first:
        try:
            stacked[field] = np.stack([np.asarray(ex[field]) for ex in examples])
        except (KeyError, TypeError) as err:
            raise ValueError(f"Loader: examples {shown(keys)} do not all have the fields "
                             f"{sorted(first)} ({err!r}); every example must have the same "
                             "fields") from err
        except ValueError as err:
            shapes = sorted({np.shape(ex[field]) for ex in examples})
            raise ValueError(f"Loader: field {field!r} has different shapes {shapes[:4]} "
                             f"across examples {shown(keys)}; make every example's {field!r} "
                             "the same shape (pad or resize it in the source)") from err
    return stacked


def _same_fields(examples: Sequence, keys: list[int]) -> None:
    """Every example has the same field names; else a ValueError naming the odd indices (the
    same message whichever example of the batch comes first)."""
    groups: dict[tuple, list[int]] = {}
    for k, ex in zip(keys, examples, strict=True):
        groups.setdefault(tuple(sorted(ex)) if isinstance(ex, Mapping) else (), []).append(k)
    if len(groups) > 1:
        (common, most), *rest = sorted(groups.items(), key=lambda g: (-len(g[1]), min(g[1])))
        odd = ", ".join(f"example(s) {shown(sorted(ks))} have {list(f)}" for f, ks in rest)
        raise ValueError(f"Loader: {odd}, but example(s) {shown(sorted(most))} have "
                         f"{list(common)}; every example must have the same fields")


def _check_no_mask(fields: Mapping, where: str) -> None:
    if MASK in fields:
        raise ValueError(f"Loader: {where} has a field named {MASK!r}, which the Loader adds "
                         "itself (True for real examples); rename that field")


class Recipe(NamedTuple):
    """How to turn example indices into a host batch (fixed for a Loader's life)."""
    read: Reader
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
    if recipe.transform is not None:
        rng = {"rng": example_rngs(plan.seed, plan.epoch, idx)} if recipe.augment else {}
        try:
            out = recipe.transform(fields, **rng)
        except Exception as err:
            err.add_note(f"Loader: raised by transform on batch {b} of epoch {plan.epoch} "
                         f"(example indices {shown(idx.tolist())})")
            raise
        fields = check_transformed(out, plan.batch_size)
    check_dtypes(fields)
    return {**fields, MASK: real}


def check_transformed(fields: Any, size: int) -> dict:
    """The transform's output is a dict of arrays with one row per example and no "mask"."""
    if not isinstance(fields, Mapping):
        raise TypeError(f"Loader: transform returned a {type(fields).__name__}; expected the "
                        "batch dict (transform(batch) -> batch)")
    _check_no_mask(fields, "transform's output")
    for path, leaf in jax.tree_util.tree_flatten_with_path(dict(fields))[0]:
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] != size:
            rows = f"{np.shape(leaf)[0]} row(s)" if np.ndim(leaf) else "no rows"
            raise ValueError(f"Loader: transform returned {jax.tree_util.keystr(path)} with "
                             f"{rows} (shape {np.shape(leaf)}); expected batch_size={size} "
                             "rows, one per example of the batch (padding rows included): "
                             "keep the batch's rows")
    return dict(fields)


def check_dtypes(fields: Mapping) -> None:
    """Every leaf can go on a device: no strings, bytes or Python objects."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(dict(fields))[0]:
        dtype = np.asarray(leaf).dtype
        if dtype.kind in "USOV":
            raise TypeError(f"Loader: field {jax.tree_util.keystr(path)} has dtype {dtype} "
                            "(strings or objects), which cannot go on a device; drop it, or "
                            "turn it into numbers in transform=")
