"""`evaluate`: a metric over a whole split in one call, exact, as plain numbers.

The loop every evaluation needs (batches from a Loader, `jdp.eval_step` on each, the masked
sums added up, divided by the count at the end) written once, so that no script writes it
again and none gets the padding or the cross-process sum wrong.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from jdp.core import eval_step
from jdp.data import _sources
from jdp.data._loader import Loader
from jdp.data._sampler import _require_int
from jdp.distributed import agree, agree_once

_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # metric_fn -> its eval step
_METRIC_TREES: set = set()   # metric trees the processes agreed on


def evaluate(metric_fn: Callable, state: Any, data: Any, *, batch_size: int | None = None
             ) -> dict[str, float]:
    """Evaluate `metric_fn` over every example of `data` once: the means, as Python floats.

    `metric_fn(state, batch)` is `jdp.eval_step`'s: one device's slice of the batch in,
    `{name: per-example values [per_device_batch]}` out. Each value is summed over the real
    examples of all devices of all processes (padding masked out) and divided by their number,
    so the result is the exact mean over the split, whatever the device and process count.
    Every process calls it and gets the same numbers.

    Args:
        metric_fn: `metric_fn(state, batch) -> {name: per-example values}`, e.g.
            `{"accuracy": logits.argmax(-1) == batch["label"], "loss": per_example_loss}`.
        state: the state from `jdp.broadcast` (or any tree of global arrays on `jdp.mesh()`).
        data: a `jdp.data.Loader` at the start of an epoch (one whole pass is taken), or a
            source the Loader takes (a dict of arrays, an `ArraySource`, a TFDS/grain source),
            read in order with `batch_size` examples per process (a list of dicts is one
            example per dict; a list of batches or of arrays is refused, naming the fix).
        batch_size: examples per process and batch when `data` is a source; default the
            smallest multiple of the local device count that is >= 128.

    Returns:
        `{name: mean over the examples}` as floats, plus "count": the number of examples.

    Every process must pass the same kind of split, of as many examples, and `metric_fn`
    must return the same metrics (names, dtypes, shapes) on every process: both are agreed
    before the sum across processes runs, and a difference raises ValueError on every process
    naming it and the processes on each side.

    Raises:
        ValueError: the Loader is mid-epoch or drops examples (`drop_last`), so the pass would
            not cover the split exactly once; `batch_size` given with a Loader, or below 1;
            an empty split, or one with fewer examples than processes; the processes
            disagree (above).
        TypeError: `data` is a list or tuple of batches or of arrays, an array, or an
            iterator, not a split or a Loader.

    Example:
        >>> import jdp, numpy as np
        >>> def metric_fn(state, batch):
        ...     return {"sq": (batch["x"] * state["w"]) ** 2}
        >>> jdp.evaluate(metric_fn, jdp.broadcast({"w": np.float32(2)}),
        ...              {"x": np.ones(13, np.float32)})
        {'sq': 4.0, 'count': 13.0}
    """
    loader = _whole_pass(data, batch_size)   # checked here first: the same data, the same line
    agree("evaluate", [("the split's type", type(data).__name__),
                       ("the split's examples", _size(data)), ("batch_size", str(batch_size))],
          "jdp.evaluate",
          "call jdp.evaluate with the same split and arguments on every process")
    step = _STEPS.get(metric_fn)
    if step is None:
        step = _STEPS[metric_fn] = eval_step(metric_fn)
    totals = None
    for batch in loader:
        if totals is None:
            _check_metrics(metric_fn, state, batch, data)
        out = step(state, batch)
        totals = out if totals is None else jax.tree.map(lambda a, b: a + b, totals, out)
    if totals is None:
        raise ValueError("jdp.evaluate: the data gave no batch; pass a split with examples")
    sums = {k: float(np.asarray(v.addressable_data(0))) for k, v in totals.items()}
    count = sums.pop("count")
    return {**{k: v / count for k, v in sums.items()}, "count": count}


def _whole_pass(data: Any, batch_size: int | None) -> Loader:
    """`data` as a Loader that is about to hand out a whole epoch, every example once."""
    if not isinstance(data, Loader):
        return _source_loader(data, batch_size)
    if batch_size is not None:
        raise ValueError(f"jdp.evaluate: batch_size={batch_size} was given with a Loader, which "
                         f"has its own (batch_size={data.batch_size}); drop batch_size=")
    if data.drop_last or data.sampler.drop_last:
        raise ValueError("jdp.evaluate: the Loader drops examples (drop_last=True on the Loader "
                         "or its sampler), so the mean would miss some; build the evaluation "
                         "Loader with drop_last=False (padding is masked out)")
    if data.step:
        raise ValueError(f"jdp.evaluate: the Loader is at step {data.step} of epoch "
                         f"{data.epoch}, so one pass would miss its first {data.step} batches; "
                         "pass a Loader at the start of an epoch (a separate one for evaluation)")
    return data


def _source_loader(data: Any, batch_size: int | None) -> Loader:
    """A Loader reading the source `data` in order; one line for what is no source (a list,
    tuple or iterator), an empty split or one too small for the processes, a bad batch_size."""
    n = jax.local_device_count()
    size = -(-128 // n) * n if batch_size is None else _require_int(
        "jdp.evaluate", "batch_size", batch_size, 1,
        f"pass the examples per process and batch (a multiple of the {n} local devices)")
    if (wrong := _not_a_split(data)) is not None:
        raise TypeError(wrong)
    try:
        count = _sources.make_reader(data)[0]
    except TypeError:
        raise TypeError(f"jdp.evaluate: data of type {type(data).__name__} is neither a "
                        "jdp.data.Loader nor a source of examples; pass a Loader at the start "
                        "of an epoch, a dict of arrays, or an object with __len__ and "
                        "__getitem__ (e.g. tfds.data_source(...))") from None
    if count == 0:
        raise ValueError("jdp.evaluate: the split is empty (0 examples), so there is no mean to "
                         "take; pass the split's examples")
    if count < jax.process_count():
        raise ValueError(f"jdp.evaluate: the split has {count} example(s) for "
                         f"{jax.process_count()} processes, and each process evaluates its own "
                         f"share: pass a split of at least {jax.process_count()} examples, or "
                         "evaluate it on fewer processes")
    return Loader(data, batch_size=size, prefetch=2)


def _size(data: Any) -> str:
    """The split's number of examples as the processes compare it; '?' where it has none."""
    if isinstance(data, Loader):
        return str(data.sampler.num_examples)
    try:
        return str(len(next(iter(data.values())) if isinstance(data, Mapping) else data))
    except (TypeError, StopIteration):
        return "?"


def _not_a_split(data: Any) -> str | None:
    """Why `data` is no split, naming what it holds, what evaluate takes and the fix; None
    for anything else (a list of dicts is a source of one example per dict)."""
    what = f"jdp.evaluate: data is a {type(data).__name__}"
    takes = ("; it takes the split's fields as one dict of arrays with a row per example "
             "({'x': x, 'label': y}), an ArraySource, a TFDS/Grain source, a list of example "
             "dicts, or a jdp.data.Loader at the start of an epoch")
    if isinstance(data, Iterator):
        return f"{what} of batches (an iterator){takes}, not batches of it"
    if isinstance(data, (np.ndarray, jax.Array)):
        return f"{what} of shape {data.shape}{takes}: name it, e.g. {{'x': data}}"
    if not isinstance(data, (list, tuple)) or not data:
        return None
    first = data[0]
    if isinstance(first, Mapping) and ("mask" in first or any(
            isinstance(x, jax.Array) for x in jax.tree.leaves(first))):
        return (f"{what} of batches ({len(data)}, from a Loader or jdp.shard){takes}, not its "
                "batches")
    if isinstance(first, Mapping):
        return None
    shapes = [np.shape(x) for x in data[:4]]
    return (f"{what} of {len(data)} {type(first).__name__} values (shapes {shapes}"
            f"{', ...' if len(data) > 4 else ''}){takes}: name its fields, e.g. "
            "{'x': data[0], 'label': data[1]}, as metric_fn reads them from the batch")


def _check_metrics(metric_fn: Callable, state: Any, batch: dict, data: Any) -> None:
    """Before the first step (and its sum across processes) runs: the processes agree on what
    metric_fn returns, names, dtypes and per-device shapes, worked out by `jax.eval_shape`
    (the step agrees on it too while it traces, in its own name); and a list of dicts read as
    examples is named as the split if metric_fn gives more than one value per example. One
    process with a split that is no list: nothing to do."""
    listed = isinstance(data, (list, tuple))
    if jax.process_count() == 1 and not listed:
        return
    rows = batch["mask"].shape[0] // jax.device_count()
    piece = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), batch)
    try:
        tree = jax.eval_shape(metric_fn, state, piece)
        shapes = {k: v.shape for k, v in tree.items()}
    except Exception:  # noqa: BLE001 -- what else is wrong is named by the step's checks
        return
    if listed and any(shape != (rows,) for shape in shapes.values()):
        raise ValueError(_batches_as_examples(data, shapes, rows))
    agree_once(_METRIC_TREES, "evaluate-metrics", tree, "jdp.evaluate",
               "every process's metric_fn must return the same metrics (names, dtypes, "
               "per-example shapes) for the same batch")


def _batches_as_examples(data: Any, shapes: dict, rows: int) -> str:
    """A list of dicts read as one example each gives more than one value per example: most
    likely the dicts are batches. Named as the split: what it got, what it takes."""
    fields = {k: np.shape(v) for k, v in data[0].items()}
    return (f"jdp.evaluate: data is a {type(data).__name__} of {len(data)} dicts, read as one "
            f"example each (the first: shapes {fields}), but metric_fn returns {shapes} for "
            f"{rows} of them, not one value per example: if the dicts are batches, join them "
            "into the split, {k: np.concatenate([b[k] for b in data]) for k in data[0]}; if "
            "they are examples, return one value each")
