"""jdp.datasets: the offline digits, MNIST through TFDS (mocked, no network, no TensorFlow),
and the one-line error for a dataset that is not prepared."""
import time

import jax
import numpy as np
import pytest

import jdp
from jdp.data import DistributedSampler, Loader


@pytest.fixture(scope="module")
def digits():
    return {split: jdp.datasets.load("digits", split).arrays for split in ("train", "test")}


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
    again = jdp.datasets.load("digits", "test")
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
    with pytest.raises(ValueError, match="'cifar'.*digits"):
        jdp.datasets.load("cifar", "train")
    with pytest.raises(ValueError, match="'validation'"):
        jdp.datasets.load("digits", "validation")


def test_mnist_not_prepared_offline_fails_fast_with_a_one_line_fix(tmp_path):
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        jdp.datasets.load("mnist", "train", data_dir=str(tmp_path))
    assert time.monotonic() - start < 20
    message = str(info.value)
    assert "\n" not in message
    for word in (str(tmp_path), 'pip install "jdp[prepare]"', "download_and_prepare",
                 "file_format='array_record'", "--data-dir"):
        assert word in message, word


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
def test_tfds_source_feeds_the_loader_under_mock_data(tmp_path, name):
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=37, policy=tfds.testing.MockPolicy.USE_CODE):
        source = jdp.datasets.load(name, "train", data_dir=str(tmp_path))
        assert len(source) == 37
        example = source[3]
        assert example["image"].shape == (28, 28, 1) and example["image"].dtype == np.uint8
        rows = []
        for rank in range(2):
            sampler = DistributedSampler(37, num_replicas=2, rank=rank, shuffle=True, seed=1)
            real = sampler.indices()[~sampler.is_padding()]  # epoch 0; iterating moves to 1
            batches = list(Loader(source, 16, sampler=sampler))
            assert len(batches) == 2 and batches[0]["image"].shape == (8, 2, 28, 28, 1)
            images = np.concatenate([np.asarray(b["image"])[np.asarray(b["mask"])]
                                     for b in batches])
            np.testing.assert_array_equal(images, np.stack([source[i]["image"] for i in real]))
            rows += real.tolist()
        assert sorted(rows) == list(range(37))
