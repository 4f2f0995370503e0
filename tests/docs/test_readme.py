"""The README's and docs/'s code runs: their `python` blocks, executed with the names they take
as given, checked against independent computations (numpy, flax, optax).

Each test runs some blocks in one namespace after a prelude that defines what the page leaves
to the reader (data, a model, an optimizer). Blocks that are fragments of a script (`jdp.spawn`'s
`main`, the preemption loop of docs/faults.md) are covered by the example and launcher tests
instead. The README's two commands and the links between the pages are checked too.
"""
import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import NUM_DEVICES, REPO

import jdp

PAGES = ["README.md", *(f"docs/{f}" for f in sorted(os.listdir(f"{REPO}/docs")))]


def text(page: str) -> str:
    with open(f"{REPO}/{page}") as f:
        return f.read()


def block(first_line: str, page: str = "README.md") -> str:
    """The block of `page` that starts with `first_line`."""
    found = [b for b in re.findall(r"```python\n(.*?)```", text(page), re.S)
             if b.startswith(first_line)]
    assert len(found) == 1, f"{page} has {len(found)} python blocks starting {first_line!r}"
    return found[0]


def run(code: str, namespace: dict, page: str = "README.md") -> dict:
    """Execute a block in `namespace`, which starts with the quickstart's imports."""
    for name, module in {"jax": jax, "jnp": jnp, "np": np, "optax": optax, "jdp": jdp}.items():
        namespace.setdefault(name, module)
    exec(compile(code, page, "exec"), namespace)
    return namespace


def sgd_mse(w: np.ndarray, x: np.ndarray, y: np.ndarray, lr: float = 0.1) -> np.ndarray:
    """One SGD step on mean((x w - y)^2) over the whole batch, in float64."""
    return w - lr * 2.0 * x.T @ (x @ w - y) / len(x)


class BNNet(nn.Module):
    """A small model with BatchNorm, called as docs/api.md calls it (`train=`)."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x.reshape(x.shape[0], -1))
        return nn.Dense(10)(x)


def test_the_two_commands_stay_as_ci_runs_them():
    first = re.search(r"```bash\n(.*?)```", text("README.md"), re.S).group(1)
    assert [line.split("#")[0].strip() for line in first.splitlines()] == [
        "make install demo", "make test"]


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES)
def test_every_link_between_the_pages_finds_its_page_and_heading(page):
    for target, anchor in re.findall(r"\]\(([\w./-]*\.md|)(?:#([\w-]+))?\)", text(page)):
        path = os.path.normpath(os.path.join(os.path.dirname(page), target or page.split("/")[-1]))
        assert os.path.exists(f"{REPO}/{path}"), f"{page} links to {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", text(path), re.M)
            assert anchor in {slug(h) for h in headings}, f"{page}: no heading #{anchor} in {path}"


def test_the_readme_loop_is_sgd_over_the_samplers_shuffled_batches_then_one_pmap_step(capsys):
    ns = run(block("import jax.numpy as jnp, numpy as np, optax"), {})
    x, y = (ns["source"][k].astype(np.float64) for k in ("x", "y"))
    out, w = capsys.readouterr().out, np.zeros((2, 1))
    for epoch in range(3):  # the sampler's documented order: default_rng(seed + epoch)
        order = np.random.default_rng(0 + epoch).permutation(len(x))
        for i in range(0, len(x), 128):
            rows = order[i:i + 128]
            loss, w = np.mean((x[rows] @ w - y[rows]) ** 2), sgd_mse(w, x[rows], y[rows])
        printed = re.findall(rf"epoch {epoch}: loss (\S+)", out)
        assert printed and float(printed[0]) == pytest.approx(loss, rel=1e-3, abs=1e-5)
    np.testing.assert_allclose(np.asarray(ns["state"].params["w"]), w, rtol=1e-5, atol=1e-7)
    assert int(ns["state"].step) == 24
    # The pmap block continues from the loop's state with the first 128 rows.
    run(block("state = jdp.pmap.replicate(state)"), ns)
    assert float(jdp.pmap.unreplicate(ns["metrics"])["loss"]) == pytest.approx(
        np.mean((x[:128] @ w - y[:128]) ** 2), rel=1e-4)
    np.testing.assert_allclose(np.asarray(jdp.pmap.unreplicate(ns["state"]).params["w"]),
                               sgd_mse(w, x[:128], y[:128]), rtol=1e-5, atol=1e-7)


def test_the_api_quickstart_in_both_forms_takes_one_sgd_step_of_the_global_batch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2 * NUM_DEVICES, 2)).astype(np.float32)
    y = rng.standard_normal((2 * NUM_DEVICES, 1)).astype(np.float32)
    ns = run(block("import jax, jax.numpy as jnp, numpy as np, optax", "docs/api.md"),
             {"x": x, "y": y}, "docs/api.md")
    # From w = 0: loss = mean(y^2), one step w = -0.1 * d/dw mean((x w - y)^2) = 0.2 x^T y / B.
    want_w = 0.2 * x.T @ y / len(x)
    assert float(ns["metrics"]["loss"]) == pytest.approx(float(np.mean(y ** 2)), rel=1e-6)
    np.testing.assert_allclose(np.asarray(ns["params"]["w"]), want_w, rtol=1e-5)
    ns["state"] = jdp.TrainState.create(apply_fn=None, params={"w": jnp.zeros((2, 1))},
                                        tx=optax.sgd(0.1))
    run(block("state = jdp.pmap.replicate(state)", "docs/api.md"), ns, "docs/api.md")
    np.testing.assert_allclose(np.asarray(ns["params"]["w"]), want_w, rtol=1e-5)
    assert float(jdp.pmap.unreplicate(ns["metrics"])["loss"]) == pytest.approx(
        float(np.mean(y ** 2)), rel=1e-6)


def test_batchnorm_zero_loader_and_checkpoint_blocks_train_and_save(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the checkpoint block saves into "ckpt"
    rng = np.random.default_rng(0)
    source = {"image": rng.standard_normal((512, 4, 4, 1)).astype(np.float32),
              "label": rng.integers(0, 10, 512).astype(np.int32)}
    ns = {"model": BNNet(), "key": jax.random.key(0), "x": source["image"][:2],
          "tx": optax.adam(1e-2), "images": source["image"], "labels": source["label"],
          "num_epochs": 2}
    page = "docs/api.md"
    run(block("variables = model.init(key, x, train=False)", page), ns, page)
    run(block("state = jdp.broadcast(state, shard_optimizer=True)", page), ns, page)
    run(block("source = jdp.data.ArraySource(", page), ns, page)
    assert int(ns["state"].step) == 4  # 2 epochs x 512 examples / 256
    assert np.isfinite(float(ns["metrics"]["loss"]))
    ns["num_epochs"] = 3
    run(block('ckpt = jdp.checkpoint.Checkpointer("ckpt", max_to_keep=3)', page), ns, page)
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
    batch = jdp.shard({"image": images, "label": labels})
    ns = run(block("def metric_fn(state, batch):", "docs/api.md"),
             {"state": state, "batch": batch}, "docs/api.md")
    logits = model.apply({"params": params}, images)
    assert ns["accuracy"] == pytest.approx(float(np.mean(logits.argmax(-1) == labels)))
    assert float(ns["totals"]["count"]) == len(images)


def test_the_nnx_block_trains_and_threads_its_batchnorm_state():
    from flax import nnx
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.BatchNorm(4, rngs=nnx.Rngs(0)),
                           nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
    ns = run(block("graphdef, params, rest = nnx.split(model, nnx.Param, ...)", "docs/api.md"),
             {"nnx": nnx, "model": model, "tx": optax.sgd(0.1)}, "docs/api.md")
    rng = np.random.default_rng(2)
    batch = jdp.shard({"x": rng.standard_normal((4 * NUM_DEVICES, 3)).astype(np.float32),
                       "y": rng.standard_normal((4 * NUM_DEVICES, 1)).astype(np.float32)})
    state = jdp.broadcast(ns["state"])
    before = jax.tree.leaves(jax.device_get(state.model_state))
    state, metrics = jdp.train_step(ns["loss_fn"])(state, batch)
    assert np.isfinite(float(metrics["loss"])) and int(state.step) == 1
    after = jax.tree.leaves(jax.device_get(state.model_state))
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_the_pooling_block_equals_flax_max_pool():
    ns = run(block("def max_pool_2x2(x):", "docs/performance.md"), {}, "docs/performance.md")
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 8, 6, 3)), jnp.float32)
    np.testing.assert_array_equal(ns["max_pool_2x2"](x), nn.max_pool(x, (2, 2), (2, 2)))
