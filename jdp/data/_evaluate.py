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
from jdp.distributed import agree

_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # metric_fn -> its eval step


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
            read in order with `batch_size` examples per process.
        batch_size: examples per process and batch when `data` is a source; default the
            smallest multiple of the local device count that is >= 128.

    Returns:
        `{name: mean over the examples}` as floats, plus "count": the number of examples.

    Raises:
        ValueError: the Loader is mid-epoch or drops examples (`drop_last`), so the pass would
            not cover the split exactly once; `batch_size` given with a Loader, or below 1;
            an empty split.
        TypeError: `data` is a list of batches (from a Loader or `jdp.shard`) or an iterator,
            not a split or a Loader.

    Example:
        >>> import jdp, numpy as np
        >>> def metric_fn(state, batch):
        ...     return {"sq": (batch["x"] * state["w"]) ** 2}
        >>> jdp.evaluate(metric_fn, jdp.broadcast({"w": np.float32(2)}),
        ...              {"x": np.ones(13, np.float32)})
        {'sq': 4.0, 'count': 13.0}
    """
    agree("evaluate", [("batch_size", str(batch_size))], "jdp.evaluate",
          "call jdp.evaluate with the same arguments on every process")
    loader = _whole_pass(data, batch_size)
    step = _STEPS.get(metric_fn)
    if step is None:
        step = _STEPS[metric_fn] = eval_step(metric_fn)
    totals = None
    for batch in loader:
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
    """A Loader reading the source `data` in order; one line for what is no source: a list
    or iterator of batches, an empty split, a batch_size below 1."""
    n = jax.local_device_count()
    size = -(-128 // n) * n if batch_size is None else _require_int(
        "jdp.evaluate", "batch_size", batch_size, 1,
        f"pass the examples per process and batch (a multiple of the {n} local devices)")
    if _is_batches(data):
        raise TypeError(f"jdp.evaluate: data is a {type(data).__name__} of batches; pass the "
                        "split itself (a dict of arrays or a source, read with batch_size=), or "
                        "a jdp.data.Loader at the start of an epoch, not its batches")
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
    return Loader(data, batch_size=size, prefetch=2)


def _is_batches(data: Any) -> bool:
    """An iterator, or a list/tuple whose items are batches: a `mask` field (the Loader's) or
    global jax.Arrays (`jdp.shard`), never an example of a source."""
    if isinstance(data, Iterator):
        return True
    if not isinstance(data, (list, tuple)) or not data or not isinstance(data[0], Mapping):
        return False
    return "mask" in data[0] or any(isinstance(x, jax.Array) for x in jax.tree.leaves(data[0]))
