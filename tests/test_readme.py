"""README's code runs: its `python` blocks, executed in order with the names they take as given.

Each test runs some blocks in one namespace after a prelude that defines what the README leaves
to the reader (data, a model, an optimizer), then checks the result against numpy or flax.
Blocks that are fragments of a script (`jdp.spawn`'s `main`, the one-line preemption loop) are
covered by the example and launcher tests instead.
"""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import NUM_DEVICES, REPO

import jdp

with open(f"{REPO}/README.md") as _f:
    BLOCKS = re.findall(r"```python\n(.*?)```", _f.read(), re.S)


def block(first_line: str) -> str:
    """The README block that starts with `first_line`."""
    found = [b for b in BLOCKS if b.startswith(first_line)]
    assert len(found) == 1, f"README has {len(found)} python blocks starting {first_line!r}"
    return found[0]


def run(code: str, namespace: dict) -> dict:
    """Execute a block in `namespace`, which starts with the quickstart's imports."""
    for name, module in {"jax": jax, "jnp": jnp, "np": np, "optax": optax, "jdp": jdp}.items():
        namespace.setdefault(name, module)
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace


class BNNet(nn.Module):
    """A small model with BatchNorm, called as the README calls it (`train=`)."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x.reshape(x.shape[0], -1))
        return nn.Dense(10)(x)


def test_the_quickstart_on_both_layouts_takes_one_sgd_step_of_the_global_batch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2 * NUM_DEVICES, 2)).astype(np.float32)
    y = rng.standard_normal((2 * NUM_DEVICES, 1)).astype(np.float32)
    ns = run(block("import jax, jax.numpy as jnp, numpy as np, optax"), {"x": x, "y": y})
    # From w = 0: loss = mean(y^2), one step w = -0.1 * d/dw mean((x w - y)^2) = 0.2 x^T y / B.
    want_w = 0.2 * x.T @ y / len(x)
    assert float(ns["metrics"]["loss"]) == pytest.approx(float(np.mean(y ** 2)), rel=1e-6)
    np.testing.assert_allclose(np.asarray(ns["params"]["w"]), want_w, rtol=1e-5)
    ns["state"] = jdp.TrainState.create(apply_fn=None, params={"w": jnp.zeros((2, 1))},
                                        tx=optax.sgd(0.1))
    run(block("state = jdp.replicate(state)"), ns)
    np.testing.assert_allclose(np.asarray(ns["params"]["w"]), want_w, rtol=1e-5)


def test_batchnorm_zero_loader_and_checkpoint_blocks_train_and_save(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the checkpoint block saves into "ckpt"
    rng = np.random.default_rng(0)
    source = {"image": rng.standard_normal((512, 4, 4, 1)).astype(np.float32),
              "label": rng.integers(0, 10, 512).astype(np.int32)}
    ns = {"model": BNNet(), "key": jax.random.key(0), "x": source["image"][:2],
          "tx": optax.adam(1e-2), "images": source["image"], "labels": source["label"],
          "num_epochs": 2}
    run(block("variables = model.init(key, x, train=False)"), ns)
    run(block("state = jdp.broadcast(state, shard_optimizer=True)"), ns)
    run(block("source = jdp.data.ArraySource("), ns)
    assert int(ns["state"].step) == 4  # 2 epochs x 512 examples / 256
    assert np.isfinite(float(ns["metrics"]["loss"]))
    ns["num_epochs"] = 3
    run(block('ckpt = jdp.checkpoint.Checkpointer("ckpt", max_to_keep=3)'), ns)
    assert int(ns["state"].step) == 6
    assert jdp.checkpoint.Checkpointer(tmp_path / "ckpt").latest_step() == 6
    restored = jdp.checkpoint.Checkpointer(tmp_path / "ckpt").restore(ns["state"])
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(ns["state"].params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_eval_block_counts_correct_predictions_over_all_devices():
    rng = np.random.default_rng(1)
    model = nn.Dense(10)
    images = rng.standard_normal((8 * NUM_DEVICES, 5)).astype(np.float32)
    labels = rng.integers(0, 10, len(images)).astype(np.int32)
    params = model.init(jax.random.key(1), images[:1])["params"]
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=model.apply, params=params,
                                                tx=optax.sgd(0.1)))
    batch = jdp.shard({"image": images, "label": labels}, layout="global")
    ns = run(block("def metric_fn(state, batch):"), {"state": state, "batch": batch})
    logits = model.apply({"params": params}, images)
    assert ns["accuracy"] == pytest.approx(float(np.mean(logits.argmax(-1) == labels)))
    assert float(ns["totals"]["count"]) == len(images)


def test_the_nnx_block_trains_and_threads_its_batchnorm_state():
    from flax import nnx
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.BatchNorm(4, rngs=nnx.Rngs(0)),
                           nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
    ns = run(block("graphdef, params, rest = nnx.split(model, nnx.Param, ...)"),
             {"nnx": nnx, "model": model, "tx": optax.sgd(0.1)})
    rng = np.random.default_rng(2)
    batch = jdp.shard({"x": rng.standard_normal((4 * NUM_DEVICES, 3)).astype(np.float32),
                       "y": rng.standard_normal((4 * NUM_DEVICES, 1)).astype(np.float32)},
                      layout="global")
    state = jdp.broadcast(ns["state"])
    before = jax.tree.leaves(jax.device_get(state.model_state))
    state, metrics = jdp.train_step(ns["loss_fn"])(state, batch)
    assert np.isfinite(float(metrics["loss"])) and int(state.step) == 1
    after = jax.tree.leaves(jax.device_get(state.model_state))
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_the_pooling_block_equals_flax_max_pool():
    ns = run(block("def max_pool_2x2(x):"), {})
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 8, 6, 3)), jnp.float32)
    np.testing.assert_array_equal(ns["max_pool_2x2"](x), nn.max_pool(x, (2, 2), (2, 2)))
