"""Bad input to the parallel steps fails before pmap with one clear message."""
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_step import N, data, mlp_params, mse

import jdp


@pytest.fixture
def state():
    return jdp.replicate(jdp.TrainState.create(apply_fn=None, params=mlp_params(),
                                               tx=optax.sgd(0.1)))


def test_batch_leading_axis_not_the_device_count(state):
    batch = data(N * 2)  # [16, ...], not [8, 2, ...]
    with pytest.raises(ValueError, match=r"batch leaf \['x'\] has shape \(16, 5\).*jdp.shard"):
        jdp.train_step(mse)(state, batch)


def test_leaves_with_unequal_per_device_batch(state):
    batch = jdp.shard(data(N * 2))
    batch["y"] = jdp.shard(np.zeros((N * 3, 1), np.float32))
    with pytest.raises(ValueError, match=r"\['y'\] has 3 examples per device but \['x'\] has 2"):
        jdp.train_step(mse)(state, batch)


def test_unreplicated_state_is_named(state):
    plain = jdp.TrainState.create(apply_fn=None, params=mlp_params(), tx=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"state leaf .* expected one copy per local device.*"
                                         r"jdp.replicate\(state\)"):
        jdp.train_step(mse)(plain, jdp.shard(data(N * 2)))


def test_non_scalar_loss(state):
    def per_example(params, batch):
        return jnp.sum((batch["x"] @ params["w1"]) ** 2, axis=1)

    with pytest.raises(ValueError, match=r"loss of shape \(2,\): expected a scalar.*jnp.mean"):
        jdp.train_step(per_example)(state, jdp.shard(data(N * 2)))


def test_accum_steps_must_divide_the_per_device_batch(state):
    with pytest.raises(ValueError, match="per-device batch 2 is not divisible by accum_steps=4"):
        jdp.train_step(mse, accum_steps=4)(state, jdp.shard(data(N * 2)))


@pytest.mark.parametrize("options, match", [
    ({"grad_reduce": "avg"}, "grad_reduce='avg'"),
    ({"accum_steps": 0}, "accum_steps=0"),
    ({"model_state_sync": "max"}, "model_state_sync='max'"),
    ({"backend": "xla"}, "backend='xla'"),
])
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        jdp.train_step(mse, **options)


def test_shard_names_a_leading_axis_the_devices_do_not_divide():
    with pytest.raises(ValueError, match=r"\['x'\] has shape \(12, 5\).*divisible by the 8"):
        jdp.shard({"x": np.zeros((12, 5))})


def test_eval_metric_fn_must_return_per_example_values(state):
    def mean_only(state, batch):
        return {"err": jnp.mean(batch["x"])}

    with pytest.raises(ValueError, match=r"'err' has shape \(\): expected per-example"):
        jdp.eval_step(mean_only)(state, jdp.shard(data(N * 2)))
