"""The train step on 8 simulated devices equals single-device optax on the global batch, in
both forms: global (jdp.broadcast + jdp.train_step + jdp.shard, metrics replicated scalars) and
pmap (jdp.pmap.replicate + jdp.pmap.train_step + jdp.pmap.shard, metrics stacked)."""
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp

N = 8


class Form(NamedTuple):
    """How a user of one form places the state, makes the steps, splits rows, reads results."""
    place: Callable
    train_step: Callable
    eval_step: Callable
    shard: Callable
    one: Callable  # one copy of a state or of metrics, as host values


FORMS = {
    "global": Form(jdp.broadcast, jdp.train_step, jdp.eval_step, jdp.shard, jax.device_get),
    "pmap": Form(jdp.pmap.replicate, jdp.pmap.train_step, jdp.pmap.eval_step, jdp.pmap.shard,
                 lambda tree: jax.device_get(jdp.pmap.unreplicate(tree))),
}


def mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    return {"w1": jnp.asarray(rng.normal(size=(5, 16)), jnp.float32) * 0.5,
            "b1": jnp.zeros(16, jnp.float32),
            "w2": jnp.asarray(rng.normal(size=(16, 1)), jnp.float32) * 0.5}


def mse(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def data(n_examples, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_examples, 5)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(1, keepdims=True)).astype(np.float32)}


def single_device_steps(params, tx, batches, loss=mse):
    """Reference: plain optax on one device, each step on the whole global batch."""
    opt_state = tx.init(params)
    for b in batches:
        grads = jax.grad(loss)(params, b)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def jdp_steps(params, tx, batches, form="global", **options):
    """(parameters, last metrics) after one step per batch, as they come back (one copy)."""
    f = FORMS[form]
    state = f.place(jdp.TrainState.create(apply_fn=None, params=params, tx=tx))
    step = f.train_step(mse, **options)
    for b in batches:
        state, metrics = step(state, f.shard(b))
    return f.one(state).params, metrics


def assert_tree_close(a, b, **tol):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("tx", [optax.sgd(0.1), optax.adam(1e-2)], ids=["sgd", "adam"])
def test_one_step_on_8_devices_equals_single_device_on_global_batch(tx, form):
    batches = [data(N * 4, seed=s) for s in range(3)]
    expected = single_device_steps(mlp_params(), tx, batches)
    got, _ = jdp_steps(mlp_params(), tx, batches, form)
    assert_tree_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [{}, {"shard_optimizer": True}, {"shard_params": True}],
                         ids=["replicated", "zero", "fsdp"])
def test_the_steps_two_halves_one_after_the_other_train_as_single_device_optax(options):
    """`step.gradients` then `step.update` (what jdp.ft runs, with its sum between them)
    train as single-device optax on the global batch, and leave the state given them."""
    tx, batches = optax.adam(1e-2), [data(N * 4, seed=s) for s in range(3)]
    layout = {k: v for k, v in options.items() if k in ("shard_optimizer", "shard_params")}
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=mlp_params(), tx=tx),
                          **layout)
    step = jdp.train_step(mse, **options)
    assert step.options.shard_params == bool(options.get("shard_params"))
    for b in batches:
        grads, model_state, metrics = step.gradients(state, jdp.shard(b))
        assert not state.step.is_deleted()   # the first half never donates
        state = step.update(state, grads, model_state)
    expected = single_device_steps(mlp_params(), tx, batches)
    assert_tree_close(jax.device_get(jdp.unshard(state).params), expected, rtol=1e-5,
                      atol=1e-6)
    before_last = single_device_steps(mlp_params(), tx, batches[:-1])
    np.testing.assert_allclose(float(metrics["loss"]), float(mse(before_last, batches[-1])),
                               rtol=1e-5)


@pytest.mark.parametrize("form", FORMS)
def test_metrics_loss_is_global_batch_loss(form):
    batch = data(N * 4)
    _, metrics = jdp_steps(mlp_params(), optax.sgd(0.0), [batch], form)
    np.testing.assert_allclose(float(FORMS[form].one(metrics)["loss"]),
                               float(mse(mlp_params(), batch)), rtol=1e-5)
    if form == "global":  # one replicated scalar
        assert metrics["loss"].shape == () and metrics["loss"].sharding.is_fully_replicated
    else:                 # one equal copy per device
        assert metrics["loss"].shape == (N,)
        assert np.allclose(np.asarray(metrics["loss"]), np.asarray(metrics["loss"])[0])


@pytest.mark.parametrize("form", FORMS)
def test_grad_reduce_sum_gives_n_times_the_mean_gradient(form):
    batch = data(N * 4)
    p0 = mlp_params()
    mean_p, _ = jdp_steps(p0, optax.sgd(1.0), [batch], form, grad_reduce="mean")
    sum_p, _ = jdp_steps(p0, optax.sgd(1.0), [batch], form, grad_reduce="sum")
    grad = jax.grad(mse)(p0, batch)
    for k in p0:
        np.testing.assert_allclose(np.asarray(p0[k] - mean_p[k]), np.asarray(grad[k]),
                                   rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(p0[k] - sum_p[k]), N * np.asarray(grad[k]),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", FORMS)
def test_accum_steps_equals_one_step_on_the_whole_batch(form):
    batches = [data(N * 8, seed=s) for s in range(2)]
    tx = optax.adam(1e-2)
    expected = single_device_steps(mlp_params(), tx, batches)
    got, _ = jdp_steps(mlp_params(), tx, batches, form, accum_steps=4)
    assert_tree_close(got, expected, rtol=1e-5, atol=1e-6)


def count_all_reduces(form, batch, **options):
    f = FORMS[form]
    state = f.place(jdp.TrainState.create(apply_fn=None, params=mlp_params(),
                                          tx=optax.sgd(0.1)))
    hlo = f.train_step(mse, **options).lower(state, f.shard(batch)).compile().as_text()
    return hlo.count(" all-reduce("), hlo.count(" all-reduce-start(")


@pytest.mark.parametrize("form", FORMS)
def test_accumulation_compiles_to_one_gradient_all_reduce_per_step(form):
    batch = data(N * 8)
    plain = count_all_reduces(form, batch)
    accum = count_all_reduces(form, batch, accum_steps=4)
    assert sum(plain) >= 1
    assert accum == plain  # not 4x: the micro-batch loop holds no collective


@pytest.mark.parametrize("form", FORMS)
def test_comm_dtype_bfloat16_stays_close_to_full_precision(form):
    batch = data(N * 4)
    full, _ = jdp_steps(mlp_params(), optax.sgd(0.1), [batch], form)
    half, _ = jdp_steps(mlp_params(), optax.sgd(0.1), [batch], form, comm_dtype=jnp.bfloat16)
    assert_tree_close(half, full, rtol=0, atol=2e-3)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(half))


@pytest.mark.parametrize("form", FORMS)
def test_long_loop_without_waiting_does_not_hang(form):
    """400 steps dispatched without reading results: jdp bounds the steps in flight."""
    f = FORMS[form]
    batch = f.shard(data(N * 2))
    state = f.place(jdp.TrainState.create(apply_fn=None, params=mlp_params(),
                                          tx=optax.sgd(0.01)))
    step = f.train_step(mse)
    for _ in range(400):
        state, metrics = step(state, batch)
    assert int(f.one(state).step) == 400
    assert np.isfinite(float(f.one(metrics)["loss"]))


@pytest.mark.parametrize("form", FORMS)
def test_has_aux_metrics_are_averaged_over_devices(form):
    def loss_with_aux(params, batch):
        loss = mse(params, batch)
        return loss, {"first_x": batch["x"][0, 0]}

    f, batch = FORMS[form], data(N * 2)
    state = f.place(jdp.TrainState.create(apply_fn=None, params=mlp_params(),
                                          tx=optax.sgd(0.0)))
    _, metrics = f.train_step(loss_with_aux, has_aux=True)(state, f.shard(batch))
    expected = batch["x"][::2, 0].mean()  # device d's first example is example 2d
    np.testing.assert_allclose(float(f.one(metrics)["first_x"]), expected, rtol=1e-6)
