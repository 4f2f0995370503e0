"""jdp.evaluate: a metric over a whole split in one call, exact over an uneven split (padding
masked out), as plain Python numbers; a Loader that would not cover the split once is refused.
(Two processes: tests/system/core/test_own_step.py.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import one_line_error

import jdp

W = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]], np.float32)   # [features, classes]


def split(n):
    rng = np.random.default_rng(3)
    return {"x": rng.normal(size=(n, 2)).astype(np.float32),
            "label": rng.integers(0, 3, size=n).astype(np.int32)}


def metric_fn(state, batch):
    logits = batch["x"] @ state["w"]
    return {"accuracy": logits.argmax(-1) == batch["label"],
            "margin": logits.max(-1) - logits.min(-1)}


def expected(data):
    logits = data["x"] @ W
    return {"accuracy": float(np.mean(logits.argmax(-1) == data["label"])),
            "margin": float(np.mean(logits.max(-1) - logits.min(-1))), "count": len(logits)}


@pytest.mark.parametrize("n, batch_size", [(101, 16), (8, 64), (37, 8)])
def test_a_loader_over_an_uneven_split_counts_every_example_once(n, batch_size):
    data, state = split(n), jdp.broadcast({"w": W})
    got = jdp.evaluate(metric_fn, state, jdp.data.Loader(data, batch_size=batch_size))
    want = expected(data)
    assert got["count"] == want["count"] and got["accuracy"] == want["accuracy"]
    np.testing.assert_allclose(got["margin"], want["margin"], rtol=1e-6)
    assert all(type(v) is float for v in got.values())


def test_a_source_is_read_in_order_with_a_default_batch_size():
    data, state = split(300), jdp.broadcast({"w": W})
    got = jdp.evaluate(metric_fn, state, data)
    assert got["count"] == 300 and got["accuracy"] == expected(data)["accuracy"]
    again = jdp.evaluate(metric_fn, state, jdp.data.ArraySource(data), batch_size=8)
    assert again == pytest.approx(got, rel=1e-6)


def test_the_same_loader_evaluates_again_each_epoch():
    data, state = split(50), jdp.broadcast({"w": W})
    loader = jdp.data.Loader(data, batch_size=16)
    first = jdp.evaluate(metric_fn, state, loader)
    second = jdp.evaluate(metric_fn, jdp.broadcast({"w": -W}), loader)
    assert first["count"] == second["count"] == 50 and loader.epoch == 2
    assert first["accuracy"] == expected(data)["accuracy"]
    assert second["accuracy"] == float(np.mean((data["x"] @ -W).argmax(-1) == data["label"]))


def test_a_loader_that_would_miss_examples_is_refused_naming_the_fix():
    data, state = split(50), jdp.broadcast({"w": W})
    with pytest.raises(ValueError, match="drop_last=False"):
        jdp.evaluate(metric_fn, state, jdp.data.Loader(data, batch_size=16, drop_last=True))
    loader = jdp.data.Loader(data, batch_size=16)
    for _ in loader:
        if loader.step == 2:
            break
    with pytest.raises(ValueError, match="start of an epoch"):
        jdp.evaluate(metric_fn, state, loader)
    with pytest.raises(ValueError, match="drop batch_size="):
        jdp.evaluate(metric_fn, state, jdp.data.Loader(data, batch_size=16), batch_size=8)


def test_per_example_values_of_the_wrong_shape_name_the_expected_shape():
    with pytest.raises(ValueError, match="per-example"):
        jdp.evaluate(lambda state, b: {"s": jnp.sum(b["x"])}, jdp.broadcast({"w": W}), split(16))


def test_the_readme_own_step_block_is_sgd_over_the_next_epoch_and_evaluates_exactly():
    from test_readme import block, run, sgd_mse
    ns = run(block("import jax.numpy as jnp, numpy as np, optax"), {})
    w = np.asarray(ns["state"].params["w"], np.float64)
    ns = run(block("import jax\n\n@jax.jit"), ns)
    x, y = (ns["source"][k].astype(np.float64) for k in ("x", "y"))
    order = np.random.default_rng(3).permutation(len(x))   # epoch 3 of the sampler, seed 0
    for i in range(0, len(x), 128):
        w = sgd_mse(w, x[order[i:i + 128]], y[order[i:i + 128]])
    np.testing.assert_allclose(np.asarray(ns["state"].params["w"]), w, rtol=1e-5, atol=1e-7)
    sq = (ns["source"]["x"] @ np.asarray(ns["state"].params["w"]) - ns["source"]["y"]) ** 2
    assert ns["results"]["count"] == 1024
    assert ns["results"]["sq_err"] == pytest.approx(float(sq.mean()), rel=1e-5)


def test_a_peek_at_the_loader_first_still_counts_every_example():
    data, state = split(50), jdp.broadcast({"w": W})
    loader = jdp.data.Loader(data, batch_size=16)
    next(iter(loader))                 # gives its batch back: the Loader is at its start
    got = jdp.evaluate(metric_fn, state, loader)
    assert got["count"] == 50 and got["accuracy"] == expected(data)["accuracy"]


def test_a_list_of_example_dicts_is_one_example_each():
    data, state = split(21), jdp.broadcast({"w": W})
    examples = [{"x": data["x"][i], "label": data["label"][i]} for i in range(21)]
    got = jdp.evaluate(metric_fn, state, examples, batch_size=8)
    assert got["count"] == 21 and got["accuracy"] == expected(data)["accuracy"]


def test_a_split_given_as_arrays_or_a_list_of_arrays_is_named_as_the_split():
    data, state = split(16), jdp.broadcast({"w": W})
    for given, words in [((data["x"], data["label"]), ["data is a tuple of 2 ndarray", "(16, 2)"]),
                         ([data["x"], data["label"]], ["data is a list of 2 ndarray", "(16,)"]),
                         (data["x"], ["data is a ndarray of shape (16, 2)", "{'x': data}"])]:
        one_line_error(TypeError, ["jdp.evaluate", *words, "one dict of arrays",
                                   "jdp.data.Loader"], jdp.evaluate, metric_fn, state, given)


def test_a_list_of_batch_dicts_is_named_as_the_split_not_as_the_metrics_shape():
    data, state = split(48), jdp.broadcast({"w": W})
    batches = [{k: v[i:i + 16] for k, v in data.items()} for i in range(0, 48, 16)]
    error = one_line_error(ValueError, ["jdp.evaluate", "data is a list of 3 dicts",
                                        "read as one example each", "'x': (16, 2)",
                                        "np.concatenate"],
                           jdp.evaluate, metric_fn, state, batches)
    assert "metric_fn value" not in str(error)
    joined = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}   # the fix
    assert jdp.evaluate(metric_fn, state, joined)["accuracy"] == expected(data)["accuracy"]


def test_eval_step_says_rows_for_a_batch_that_does_not_split_over_the_devices():
    n, state = jax.device_count(), jdp.broadcast({"w": W})
    step = jdp.eval_step(metric_fn)
    odd = {k: v[:n + 4] for k, v in split(n + 4).items()}
    one_line_error(ValueError, ["jdp.eval_step", f"{n + 4} rows", f"{n} devices",
                                f"multiple of {n} rows"], step, state, odd)
    mixed = {"x": split(2 * n)["x"], "label": split(n)["label"]}
    one_line_error(ValueError, ["jdp.eval_step", f"['x'] has {2 * n} rows",
                                f"['label'] has {n}", "one row per example"], step, state, mixed)


def test_a_mask_that_is_not_one_flag_per_row_is_refused_not_counted_twice():
    n, state = jax.device_count(), jdp.broadcast({"w": W})
    batch = jdp.shard({**split(2 * n), "mask": np.ones((2 * n, 2), bool)})
    one_line_error(ValueError, ["jdp.eval_step", "batch['mask'] has shape", f"({2 * n},)"],
                   jdp.eval_step(metric_fn), state, batch)
