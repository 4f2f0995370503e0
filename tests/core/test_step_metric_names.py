"""A loss whose aux metrics hold a "loss" entry used to replace the step's objective in the
returned metrics without a word; it is refused with one line, and metrics under other names
come back beside the objective (checked against one device on the global batch)."""
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp

X = np.random.default_rng(1).normal(size=(32, 3)).astype(np.float32)
Y = X @ np.array([[1.0], [2.0], [-1.0]], np.float32)
W0 = {"w": np.full((3, 1), 0.5, np.float32)}


def data_term(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def objective(params, batch):
    return data_term(params, batch) + 0.1 * jnp.sum(params["w"] ** 2)


def state(shard_params):
    return jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=W0, tx=optax.sgd(0.1)),
                         shard_params=shard_params)


@pytest.mark.parametrize("shard_params", [False, True])
def test_a_metric_named_loss_is_refused(shard_params):
    step = jdp.train_step(lambda p, b: (objective(p, b), {"loss": data_term(p, b)}),
                          has_aux=True, shard_params=shard_params)
    with pytest.raises(ValueError) as error:
        step(state(shard_params), jdp.shard({"x": X, "y": Y}))
    text = str(error.value)
    assert "\n" not in text and "metrics hold 'loss'" in text and "rename yours" in text, text


@pytest.mark.parametrize("shard_params", [False, True])
def test_other_metrics_come_back_beside_the_objective(shard_params):
    step = jdp.train_step(lambda p, b: (objective(p, b), {"data": data_term(p, b)}),
                          has_aux=True, shard_params=shard_params)
    _, metrics = step(state(shard_params), jdp.shard({"x": X, "y": Y}))
    batch = {"x": X, "y": Y}   # one device, the global batch
    np.testing.assert_allclose(float(metrics["loss"]), float(objective(W0, batch)), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["data"]), float(data_term(W0, batch)), rtol=1e-5)
    assert float(metrics["loss"]) > float(metrics["data"])   # the objective, not the data term
