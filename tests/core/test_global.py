"""The global form (jdp.broadcast + global batches, jit of shard_map) on 8 simulated devices:
equal to single-device optax on the global batch, and to the pmap form on the same data."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_step import N, assert_tree_close, data, mlp_params, mse, single_device_steps
from test_step_models import BNNet, bn_loss, bn_state, global_batch_reference

import jdp


def global_steps(params, tx, batches, loss=mse, **options):
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=tx))
    step = jdp.train_step(loss, **options)
    for b in batches:
        state, metrics = step(state, jdp.shard(b))
    return state, metrics


def pmap_steps(params, tx, batches, **options):
    state = jdp.pmap.replicate(jdp.TrainState.create(apply_fn=None, params=params, tx=tx))
    step = jdp.pmap.train_step(mse, **options)
    for b in batches:
        state, metrics = step(state, jdp.pmap.shard(b))
    return jdp.pmap.unreplicate(state), jdp.pmap.unreplicate(metrics)


@pytest.mark.parametrize("accum", [1, 4])
@pytest.mark.parametrize("tx", [optax.sgd(0.1, momentum=0.9), optax.adam(1e-2)],
                         ids=["sgd", "adam"])
def test_global_layout_equals_single_device_on_global_batch(tx, accum):
    batches = [data(N * 8, seed=s) for s in range(3)]
    expected = single_device_steps(mlp_params(), tx, batches)
    state, _ = global_steps(mlp_params(), tx, batches, accum_steps=accum)
    assert_tree_close(jax.device_get(state.params), expected, rtol=1e-5, atol=1e-6)


def test_global_layout_equals_pmap_layout_on_the_same_data():
    batches = [data(N * 4, seed=s) for s in range(3)]
    g_state, g_metrics = global_steps(mlp_params(), optax.adam(1e-2), batches)
    p_state, p_metrics = pmap_steps(mlp_params(), optax.adam(1e-2), batches)
    assert_tree_close(jax.device_get(g_state.params), p_state.params, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(g_metrics["loss"]), float(p_metrics["loss"]), rtol=1e-6)


class BiasFreeBNNet(nn.Module):
    """BNNet without the Dense bias before BatchNorm: that bias has a zero gradient up to
    rounding, which Adam would scale up to a full step of either sign."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name=jdp.AXIS)(x)
        return nn.Dense(1)(nn.relu(x))


def test_three_adam_steps_with_batchnorm_give_the_same_state_in_both_forms():
    batches = [data(N * 4, seed=s) for s in range(3)]
    model = BiasFreeBNNet()
    state0 = bn_state(model, batches[0]["x"], optax.adam(1e-2))
    g_state, p_state = jdp.broadcast(state0), jdp.pmap.replicate(state0)
    g_step, p_step = jdp.train_step(bn_loss(model)), jdp.pmap.train_step(bn_loss(model))
    for b in batches:
        g_state, g_metrics = g_step(g_state, jdp.shard(b))
        p_state, p_metrics = p_step(p_state, jdp.pmap.shard(b))
    p_state = jdp.pmap.unreplicate(p_state)
    assert int(g_state.step) == int(p_state.step) == 3
    assert_tree_close(jax.device_get(g_state.params), p_state.params, rtol=1e-5, atol=1e-6)
    assert_tree_close(jax.device_get(g_state.model_state), p_state.model_state,
                      rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(g_metrics["loss"]),
                               float(jdp.pmap.unreplicate(p_metrics)["loss"]), rtol=1e-5)


def test_state_has_no_device_axis_and_metrics_are_plain_scalars():
    state, metrics = global_steps(mlp_params(), optax.sgd(0.1), [data(N * 2)])
    assert state.params["w1"].shape == (5, 16)
    assert state.params["w1"].sharding.is_fully_replicated
    assert metrics["loss"].shape == ()
    assert int(state.step) == 1
    np.testing.assert_allclose(float(metrics["loss"]), float(mse(mlp_params(), data(N * 2))),
                               rtol=1e-5)


def test_batchnorm_model_state_matches_global_batch_statistics():
    batch, tx = data(N * 4), optax.sgd(0.1)
    state0, ref_stats, ref_params, model = global_batch_reference(batch, tx)
    state, _ = jdp.train_step(bn_loss(model))(jdp.broadcast(state0), jdp.shard(batch))
    assert_tree_close(jax.device_get(state.model_state), ref_stats, rtol=1e-5, atol=1e-6)
    assert_tree_close(jax.device_get(state.params), ref_params, rtol=1e-5, atol=1e-6)


def test_per_device_batchnorm_without_sync_is_refused_on_the_global_layout():
    batch, tx = data(N * 4), optax.sgd(0.1)
    state = jdp.broadcast(bn_state(BNNet(), batch["x"], tx))
    step = jdp.train_step(bn_loss(BNNet()), model_state_sync=None)
    with pytest.raises(Exception, match="(?i)vary|replicat"):
        step(state, jdp.shard(batch))


def test_dropout_keys_are_the_same_in_both_layouts():
    def loss_fn(params, batch, rng):
        keep = jax.random.bernoulli(rng, 0.5, batch["x"].shape)
        return mse(params, {**batch, "x": batch["x"] * keep})

    batch = data(N * 2)

    def run(place, train_step, shard, one):
        state = place(jdp.TrainState.create(apply_fn=None, params=mlp_params(),
                                            tx=optax.sgd(0.1), seed=3))
        state, _ = train_step(loss_fn)(state, shard(batch))
        return jax.device_get(one(state).params)

    assert_tree_close(run(jdp.broadcast, jdp.train_step, jdp.shard, lambda s: s),
                      run(jdp.pmap.replicate, jdp.pmap.train_step, jdp.pmap.shard,
                          jdp.pmap.unreplicate), rtol=1e-6)


def test_eval_on_a_padded_global_batch_is_exact():
    def sq_error(state, batch):
        return {"se": jnp.sum((batch["x"] @ state["w"] - batch["y"]) ** 2, axis=1)}

    real = data(N * 3 - 5)
    w = np.ones((5, 1), np.float32)
    padded = {k: np.concatenate([v, v[:5]]) for k, v in real.items()}
    padded["mask"] = np.arange(N * 3) < N * 3 - 5
    totals = jdp.eval_step(sq_error)(jdp.broadcast({"w": w}), jdp.shard(padded))
    expected = np.sum((real["x"] @ w - real["y"]) ** 2)
    np.testing.assert_allclose(float(totals["se"]), expected, rtol=1e-5)
    assert float(totals["count"]) == N * 3 - 5


def test_reusing_a_donated_state_is_a_python_error_not_a_crash():
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=mlp_params(),
                                                tx=optax.sgd(0.1)))
    step, batch = jdp.train_step(mse), jdp.shard(data(N * 2))
    step(state, batch)
    with pytest.raises(RuntimeError, match=r"donated.*donate=False"):
        step(state, batch)


def test_a_pmap_batch_with_a_global_state_is_named():
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=mlp_params(),
                                                tx=optax.sgd(0.1)))
    batch = next(iter(jdp.data.Loader(data(N * 2), batch_size=N * 2, layout="pmap")))
    with pytest.raises(ValueError, match=r"batch leaf \['mask'\] .*not a global batch on "
                                         r"jdp.mesh\(\).*jdp.pmap.train_step"):
        jdp.train_step(mse)(state, batch)


def test_global_batch_not_divisible_by_devices_times_accum_is_named():
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=mlp_params(),
                                                tx=optax.sgd(0.1)))
    batch = jdp.shard(data(N * 2))
    with pytest.raises(ValueError, match=r"\(16, 5\).*multiple of 32"):
        jdp.train_step(mse, accum_steps=4)(state, batch)


def test_global_loader_batches_train_like_pmap_loader_batches():
    source = data(N * 6)

    def loss(params, batch):
        return mse(params, {"x": batch["x"], "y": batch["y"]})

    def run(layout, place, train_step, one):
        loader = jdp.data.Loader(source, batch_size=N * 2, shuffle=False, layout=layout)
        state = place(jdp.TrainState.create(apply_fn=None, params=mlp_params(),
                                            tx=optax.sgd(0.1)))
        step = train_step(loss)
        for batch in loader:
            state, _ = step(state, batch)
        return jax.device_get(one(state).params)

    assert_tree_close(run("global", jdp.broadcast, jdp.train_step, lambda s: s),
                      run("pmap", jdp.pmap.replicate, jdp.pmap.train_step, jdp.pmap.unreplicate),
                      rtol=1e-6, atol=1e-7)
