"""Misuse that used to work badly or say the wrong thing (issue 40's POOR cases): each is a
one-line error naming the value the user wrote and the fix, a warning, or it simply works."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import one_line_error

import jdp


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _state(shard_params=False):
    rng = np.random.default_rng(0)
    state = jdp.TrainState.create(apply_fn=None, params={"w": rng.normal(size=(8, 4))
                                                         .astype(np.float32)}, tx=optax.sgd(0.1))
    return jdp.broadcast(state, shard_params=shard_params)


def _batch():
    rng = np.random.default_rng(1)
    n = jax.device_count()
    return {"x": rng.normal(size=(2 * n, 8)).astype(np.float32),
            "y": rng.normal(size=(2 * n, 4)).astype(np.float32)}


# --- shard_params: the value the user wrote, numpy scalars taken as their Python value ------

@pytest.mark.parametrize("group", [np.int64(4), np.int32(2)])
def test_a_numpy_integer_shard_params_trains_as_the_plain_int(group):
    host = _batch()
    state = _state(shard_params=group)
    state, _ = jdp.train_step(_loss, shard_params=group)(state, jdp.shard(host))
    w0 = _state().params["w"]
    grad = jax.grad(_loss)({"w": np.asarray(w0)}, host)       # one device, the global batch
    want = np.asarray(w0) - 0.1 * np.asarray(grad["w"])
    np.testing.assert_allclose(np.asarray(jdp.unshard(state).params["w"]), want,
                               rtol=1e-5, atol=1e-6)


def test_a_numpy_bool_shard_params_is_true():
    state = _state(shard_params=np.True_)
    state, _ = jdp.train_step(_loss, shard_params=np.True_)(state, jdp.shard(_batch()))
    assert jdp.unshard(state).params["w"].shape == (8, 4)


def test_a_float_shard_params_is_named_as_a_type_problem():
    one_line_error(TypeError, ["shard_params=4.0", "is a float", "int >= 2"],
                   jdp.train_step, _loss, shard_params=4.0)


def test_a_group_size_step_on_a_replicated_state_names_the_group_written():
    step = jdp.train_step(_loss, shard_params=4)
    error = one_line_error(ValueError, ["shard_params=4:", "not sharded",
                                        "jdp.broadcast(state, shard_params=4)"],
                           step, _state(), jdp.shard(_batch()))
    assert "shard_params=True" not in str(error)


def test_a_step_without_shard_params_on_groups_names_the_groups_placed():
    one_line_error(ValueError, ["parameters are sharded", "shard_params=4"],
                   jdp.train_step(_loss), _state(shard_params=4), jdp.shard(_batch()))


@pytest.mark.parametrize("step_value, words", [
    (True, ["shard_params=True:", "groups of 4 devices", "shard_params=4)", "not all devices"]),
    (2, ["shard_params=2:", "groups of 4 devices", "not groups of 2"]),
])
def test_a_step_with_other_groups_than_the_state_names_both(step_value, words):
    one_line_error(ValueError, words, jdp.train_step(_loss, shard_params=step_value),
                   _state(shard_params=4), jdp.shard(_batch()))


def test_broadcast_of_a_plain_tree_with_a_group_size_names_the_group():
    one_line_error(TypeError, ["jdp.broadcast(shard_params=4)", "no opt_state"],
                   jdp.broadcast, {"w": np.zeros(3)}, shard_params=4)
