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


# --- jdp.evaluate and the Loader: what is not a split, named as what it is ------------------

def _sq(state, batch):
    return {"sq": batch["x"] * state["w"]}


@pytest.mark.parametrize("size", [0, -8])
def test_a_loader_batch_size_below_1_is_refused(size):
    one_line_error(ValueError, [f"batch_size={size}", "int >= 1"],
                   jdp.data.Loader, {"x": np.zeros(16, np.float32)}, batch_size=size)


@pytest.mark.parametrize("size", [0, -8])
def test_evaluate_refuses_a_batch_size_below_1_instead_of_its_default(size):
    one_line_error(ValueError, ["jdp.evaluate", f"batch_size={size}", "int >= 1"],
                   jdp.evaluate, _sq, jdp.broadcast({"w": np.float32(2)}),
                   {"x": np.ones(16, np.float32)}, batch_size=size)


def test_evaluate_names_an_empty_split():
    one_line_error(ValueError, ["jdp.evaluate", "empty (0 examples)"], jdp.evaluate, _sq,
                   jdp.broadcast({"w": np.float32(2)}), {"x": np.ones(0, np.float32)})


def test_evaluate_names_a_list_of_the_loaders_batches():
    n = jax.local_device_count()
    loader = jdp.data.Loader({"x": np.ones(4 * n, np.float32)}, batch_size=2 * n)
    one_line_error(TypeError, ["jdp.evaluate", "list of batches", "Loader"], jdp.evaluate, _sq,
                   jdp.broadcast({"w": np.float32(2)}), list(loader))


def test_evaluate_names_shard_batches_and_an_iterator():
    n = jax.local_device_count()
    batch = jdp.shard({"x": np.ones(2 * n, np.float32)})
    one_line_error(TypeError, ["tuple of batches"], jdp.evaluate, _sq,
                   jdp.broadcast({"w": np.float32(2)}), (batch, batch))
    one_line_error(TypeError, ["list_iterator of batches"], jdp.evaluate, _sq,
                   jdp.broadcast({"w": np.float32(2)}), iter([batch]))


def test_evaluate_still_reads_a_list_of_examples():
    examples = [{"x": np.float32(i)} for i in range(10)]
    got = jdp.evaluate(_sq, jdp.broadcast({"w": np.float32(2)}), examples, batch_size=8)
    assert got == {"sq": 2 * np.mean(np.arange(10)), "count": 10.0}
