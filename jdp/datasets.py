"""Datasets for the examples: MNIST and Fashion-MNIST through TFDS, and the offline `digits`.

`load(name, split)` returns a random-access source for `jdp.data.Loader` whose examples are
`{"image": uint8 [28, 28, 1], "label": int}`:

* `"mnist"`, `"fashion_mnist"`: `tfds.data_source(...)` over data prepared in `array_record`
  format. Reading needs no TensorFlow; preparing does, once, on a machine with internet
  (jdp never downloads)::

      pip install "jdp[prepare]"
      python -c "import tensorflow_datasets as tfds; \\
          tfds.builder('mnist', data_dir='D').download_and_prepare(file_format='array_record')"

  then copy `D` over and pass `data_dir='D'` (`--data-dir D` in the examples).
* `"digits"`: scikit-learn's 8x8 handwritten digits (shipped inside the package, no network),
  upsampled to 28x28 and scaled to 0..255, split 80/20 per class with a fixed seed. Returned as
  a `jdp.data.ArraySource` (numpy arrays in `.arrays`), the Loader's fast path.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from jdp._sources import ArraySource

__all__ = ["NAMES", "load"]

NAMES = ("digits", "mnist", "fashion_mnist")
"""Dataset names `load` accepts (the examples' `--dataset` choices)."""

_TFDS_NAMES = ("mnist", "fashion_mnist")
_DIGITS_SPLITS = ("train", "test")
_DIGITS_TEST_FRACTION = 0.2
_DIGITS_SEED = 0
_SIZE = 28


def load(name: str, split: str, data_dir: str | None = None) -> Any:
    """The `split` of dataset `name` as a source for `jdp.data.Loader`.

    Args:
        name: one of `NAMES`.
        split: "train" or "test" (TFDS datasets also take TFDS split strings like "train[:90%]").
        data_dir: TFDS data directory holding the prepared dataset; default TFDS's
            (`$TFDS_DATA_DIR` or `~/tensorflow_datasets`). Ignored for "digits".

    Returns:
        A source with `len(source)` examples and `source[i] == {"image": uint8 [28, 28, 1],
        "label": int}`: for "digits" a `jdp.data.ArraySource` whose `.arrays` are
        `{"image": uint8 [N, 28, 28, 1], "label": int32 [N]}`; for TFDS datasets a
        `tfds.data_source` (labels int64).

    Raises:
        ValueError: unknown name or split, or a TFDS dataset not prepared in `data_dir`
            (the message says how to prepare it).

    Example:
        >>> train = jdp.datasets.load("digits", "train")
        >>> len(train), train[0]["image"].shape, train.arrays["image"].dtype
        (1438, (28, 28, 1), dtype('uint8'))
    """
    if name == "digits":
        return _digits(split)
    if name in _TFDS_NAMES:
        return _tfds_source(name, split, data_dir)
    raise ValueError(f"jdp.datasets.load: unknown dataset {name!r}; expected one of {NAMES} "
                     "(other TFDS datasets: pass tfds.data_source(...) to the Loader directly)")


def _digits(split: str) -> ArraySource:
    if split not in _DIGITS_SPLITS:
        raise ValueError(f"jdp.datasets.load: digits has no split {split!r}; expected one of "
                         f"{_DIGITS_SPLITS}")
    from sklearn.datasets import load_digits

    raw = load_digits()
    test = _stratified_test_mask(raw.target, _DIGITS_TEST_FRACTION, _DIGITS_SEED)
    keep = test if split == "test" else ~test
    images = _upsample(raw.images[keep].astype(np.float64), _SIZE)
    # Pixel values are counts 0..16 over a 4x4 block; scale to MNIST's 0..255.
    images = np.clip(np.rint(images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    return ArraySource({"image": images[..., None], "label": raw.target[keep].astype(np.int32)})


def _stratified_test_mask(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Bool mask choosing round(fraction * count) examples of each class at random (seeded)."""
    rng = np.random.default_rng(seed)
    test = np.zeros(len(labels), bool)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        test[rng.permutation(members)[:round(fraction * len(members))]] = True
    return test


def _upsample(images: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of `[N, h, w]` images to `[N, size, size]` (pixel-centre aligned)."""
    def weights(n: int) -> np.ndarray:  # [size, n]: output pixel i as a mix of input pixels
        pos = np.clip((np.arange(size) + 0.5) * n / size - 0.5, 0, n - 1)
        low = np.floor(pos).astype(int)
        high = np.minimum(low + 1, n - 1)
        w = np.zeros((size, n))
        np.add.at(w, (np.arange(size), low), 1 - (pos - low))
        np.add.at(w, (np.arange(size), high), pos - low)
        return w

    rows, cols = weights(images.shape[1]), weights(images.shape[2])
    return np.einsum("ih,nhw,jw->nij", rows, images, cols)


def _tfds_source(name: str, split: str, data_dir: str | None) -> Any:
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:
        raise ValueError(f"jdp.datasets.load: {name!r} is read through tensorflow-datasets, "
                         'which is not installed; pip install "jdp[data]"') from err
    try:
        # download=False: never reach for the network (it would fail slowly when offline, and
        # preparing needs TensorFlow anyway); a missing dataset raises at once.
        return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except Exception as err:  # noqa: BLE001 -- TFDS raises several types for missing data
        raise ValueError(_not_prepared_message(tfds, name, split, data_dir, err)) from err


def _not_prepared_message(tfds: Any, name: str, split: str, data_dir: str | None,
                          err: Exception) -> str:
    where = data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
    prepare = ('pip install "jdp[prepare]"; python -c "import tensorflow_datasets as tfds; '
               f"tfds.builder('{name}', data_dir='{where}')"
               ".download_and_prepare(file_format='array_record')\"")
    try:
        prepared = tfds.builder(name, data_dir=data_dir).is_prepared()
    except Exception:  # noqa: BLE001 -- the message below is the useful part
        prepared = False
    if prepared:
        reason = (str(err).splitlines() or [""])[0]
        return (f"jdp.datasets.load: {name!r} split {split!r} in {where} cannot be read "
                f"({type(err).__name__}: {reason}); check the split name, and if the data was "
                f"prepared as tfrecord re-prepare it as array_record: {prepare}")
    return (f"jdp.datasets.load: {name!r} is not prepared in {where} and jdp does not download; "
            f"on a machine with internet run: {prepare} ; then copy that directory here and "
            "pass --data-dir (data_dir=) pointing to it")
