"""NNX as its tutorials write it: `nnx.Dropout(rate, rngs=rngs)` keeps a typed PRNG key in the
model's state; that key, and the other leaf kinds jdp places, work in jdp.broadcast, the steps
and checkpoints, in both forms (the key used to stop jdp.broadcast with a NumPy error naming
no leaf)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from conftest import one_line_error
from flax import nnx

import jdp
from jdp.checkpoint import Checkpointer

N = jax.local_device_count()
PLACE = {"global": jdp.broadcast, "stacked": jdp.pmap.replicate}


class Net(nnx.Module):
    def __init__(self, rate, rngs):
        self.linear = nnx.Linear(2, 1, rngs=rngs)
        self.dropout = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.linear(x))


def split(seed=0, rate=0.5):
    return nnx.split(Net(rate, nnx.Rngs(seed)), nnx.Param, ...)


def key_data(rest):
    """The dropout stream's key as raw uint32 data (one copy of a stacked key)."""
    key = rest["dropout"]["rngs"]["key"].get_value()
    return np.asarray(jax.random.key_data(key if key.ndim == 0 else key.addressable_data(0)[0]))


def dropout_key(rest):
    return rest["dropout"]["rngs"]["key"].get_value()


@pytest.mark.parametrize("form", PLACE)
def test_broadcast_places_the_dropout_key_as_a_key_of_its_kind(form):
    _, _, rest = split()
    placed = PLACE[form](rest)
    key = dropout_key(placed)
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert key.shape == (() if form == "global" else (N,))
    np.testing.assert_array_equal(key_data(placed), key_data(rest))


@pytest.mark.parametrize("saved", PLACE)
@pytest.mark.parametrize("restored", PLACE)
def test_a_checkpoint_restores_the_saved_key_in_either_form(tmp_path, saved, restored):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, PLACE[saved](split(seed=3)[2]))
    back = ckpt.restore(PLACE[restored](split(seed=9)[2]))
    assert jax.dtypes.issubdtype(dropout_key(back).dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(key_data(back), key_data(split(seed=3)[2]))
    assert not np.array_equal(key_data(back), key_data(split(seed=9)[2]))


@pytest.mark.parametrize("form", PLACE)
def test_the_step_trains_a_model_whose_state_holds_the_dropout_key(form):
    graphdef, params, rest = split(rate=0.0)   # rate 0: the same numbers as without dropout
    w0 = np.asarray(params["linear"]["kernel"].get_value())
    b0 = np.asarray(params["linear"]["bias"].get_value())
    state = jdp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1),
                                  model_state=rest)

    def loss_fn(params, batch, rest):   # the docs' NNX idiom
        model = nnx.merge(graphdef, params, rest, copy=True)
        loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
        return loss, nnx.split(model, nnx.Param, ...)[2]

    x = np.linspace(-1, 1, 4 * N, dtype=np.float32).reshape(2 * N, 2)
    y = np.ones((2 * N, 1), np.float32)
    if form == "global":
        state, step = jdp.broadcast(state), jdp.train_step(loss_fn)
        batch = jdp.shard({"x": x, "y": y})
    else:
        state, step = jdp.pmap.replicate(state), jdp.pmap.train_step(loss_fn)
        batch = jdp.pmap.shard({"x": x, "y": y})
    state, _ = step(state, batch)
    err = x @ w0 + b0 - y                     # SGD on the mean squared error, by hand
    want_w, want_b = w0 - 0.1 * 2 * x.T @ err / len(x), b0 - 0.1 * 2 * err.mean(0)
    one = jdp.pmap.unreplicate(state) if form == "stacked" else state
    np.testing.assert_allclose(np.asarray(one.params["linear"]["kernel"].get_value()), want_w,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(one.params["linear"]["bias"].get_value()), want_b,
                               rtol=1e-5, atol=1e-6)
    assert jax.dtypes.issubdtype(dropout_key(one.model_state).dtype, jax.dtypes.prng_key)


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.uint16, np.float16,
                                   ml_dtypes.bfloat16, np.complex64])
@pytest.mark.parametrize("form", PLACE)
def test_leaves_of_every_placeable_dtype_survive_broadcast_and_a_checkpoint(tmp_path, dtype,
                                                                            form):
    value = (np.arange(6) % 3).astype(dtype).reshape(3, 2)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, PLACE[form]({"v": value}))
    back = ckpt.restore(jdp.broadcast({"v": np.zeros_like(value)}))["v"]
    assert back.dtype == value.dtype
    np.testing.assert_array_equal(np.asarray(back), value)


def test_a_leaf_jdp_cannot_place_is_named_with_the_fix():
    one_line_error(TypeError, ["['name']", "str", "keep it out of the tree"],
                   jdp.broadcast, {"w": np.ones(2), "name": np.array(["relu"], dtype=object)})


def test_broadcast_from_primary_names_a_typed_key_and_the_two_fixes():
    one_line_error(TypeError, ["['rngs']['key']", "typed PRNG key", "jax.random.key_data",
                               "jdp.broadcast"],
                   jdp.broadcast_from_primary,
                   {"rngs": {"key": jax.random.key(0)}, "w": np.ones(2)})
