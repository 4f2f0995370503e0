"""docs/api.md's NNX section ("Keep your own step") runs, every block of it, and computes what
one device computes: the tutorial-style `nnx.jit` step on 8 devices equals the same functions
on one device over the Loader's batches (dropout and BatchNorm included), `jdp.evaluate` equals
a single-device pass over the uneven test set, and the `jdp.train_step` form trains."""
import re

import jax
import numpy as np
import optax
import pytest
from test_readme import run, text

nnx = pytest.importorskip("flax.nnx")
PAGE = "docs/api.md"
SECTION = "### Keep your own step: flax NNX as its tutorials write it"


def section_blocks() -> list:
    page = text(PAGE)
    start = page.index(SECTION)
    end = page.index("\n#", start + len(SECTION))
    return re.findall(r"```python\n(.*?)```", page[start:end], re.S)


def data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype(np.float32)
    teacher = np.random.default_rng(99).normal(size=(16, 10)).astype(np.float32)
    return {"x": x, "label": (x @ teacher).argmax(-1).astype(np.int32)}


def one_device_training(ns, train):
    """The page's model and train_step, unplaced, over the sampler's order on one device."""
    model = ns["MLP"](rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                              loss=nnx.metrics.Average("loss"))
    rngs, train_model = nnx.Rngs(0), nnx.view(model, deterministic=False,
                                              use_running_average=False)
    n = len(train["label"])
    for epoch in range(2):   # the DistributedSampler's documented shuffle: default_rng(seed+epoch)
        order = np.random.default_rng(epoch).permutation(n)
        for i in range(0, n - 63, 64):
            rows = order[i:i + 64]
            ns["train_step"](train_model, optimizer, metrics, rngs,
                             {k: v[rows] for k, v in train.items()})
    return model


def test_every_nnx_block_runs_and_equals_one_device():
    blocks = section_blocks()
    assert len(blocks) == 3
    train, test = data(512, 0), data(77, 1)
    ns = run(blocks[0], {"train": train, "test": test}, PAGE)
    assert jax.tree.leaves(nnx.state(ns["model"]))[0].sharding.num_devices == 8
    reference = one_device_training(ns, train)
    for got, want in zip(jax.tree.leaves(nnx.state(ns["model"])),
                         jax.tree.leaves(nnx.state(reference)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)

    run(blocks[1], ns, PAGE)
    logits = np.asarray(nnx.view(reference, deterministic=True, use_running_average=True)(
        test["x"]))
    results = ns["results"]
    assert results["count"] == 77
    assert results["accuracy"] == pytest.approx(np.mean(logits.argmax(-1) == test["label"]),
                                                 abs=1e-6)
    want_loss = optax.softmax_cross_entropy_with_integer_labels(logits, test["label"]).mean()
    assert results["loss"] == pytest.approx(float(want_loss), rel=1e-4)

    run(blocks[2], ns, PAGE)
    assert int(ns["state"].step) == len(ns["loader"]) == 8
    assert np.isfinite(float(ns["step_metrics"]["loss"]))
