"""Optimizer-state sharding (shard_optimizer=True) on 8 simulated devices equals single-device
optax on the global batch, holds 1/N of the optimizer state per device, and communicates a
reduce-scatter + all-gather instead of an all-reduce."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_step import N, assert_tree_close, data, mse, single_device_steps
from test_step_models import bn_loss, global_batch_reference

import jdp


def odd_params(seed=0):
    """Leaves split on an axis that is not the leading one (w1 (5, 16)), kept whole (w2 (16, 1)
    splits on its rows; nothing of a 5 or 1 divides 8), and a scalar."""
    rng = np.random.default_rng(seed)
    return {"w1": jnp.asarray(rng.normal(size=(5, 16)), jnp.float32) * 0.5,
            "b1": jnp.zeros(16, jnp.float32),
            "w2": jnp.asarray(rng.normal(size=(16, 1)), jnp.float32) * 0.5,
            "scale": jnp.float32(1.0)}


def scaled_mse(params, batch):
    return mse(params, batch) * params["scale"]


def weight_decay_mask(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


OPTIMIZERS = {
    "sgd_momentum": optax.sgd(0.1, momentum=0.9),
    "adam": optax.adam(1e-2),
    "adamw_masked": optax.adamw(1e-2, weight_decay=0.1, mask=weight_decay_mask),
    "clip_adam": optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)),
    "schedule": optax.adam(optax.linear_schedule(1e-2, 1e-3, 3)),
    "multisteps": optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
}


def zero_steps(tx, batches, loss=scaled_mse, **options):
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=odd_params(), tx=tx),
                          shard_optimizer=True)
    step = jdp.train_step(loss, shard_optimizer=True, **options)
    for b in batches:
        state, metrics = step(state, jdp.shard(b))
    return state, metrics


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_three_sharded_steps_equal_single_device_optax(name):
    tx = OPTIMIZERS[name]
    batches = [data(N * 4, seed=s) for s in range(3)]
    expected = single_device_steps(odd_params(), tx, batches, loss=scaled_mse)
    state, _ = zero_steps(tx, batches)
    assert_tree_close(jax.device_get(state.params), expected, rtol=1e-5, atol=1e-6)


def test_global_norm_clipping_sees_the_norm_over_all_shards():
    """The clip is active (norm > 0.1): per-shard norms would clip each slice differently."""
    batch = data(N * 4)
    norm = optax.tree.norm(jax.grad(scaled_mse)(odd_params(), batch))
    assert float(norm) > 0.1
    tx = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(1.0))
    state, _ = zero_steps(tx, [batch])
    step_taken = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), odd_params(),
                              jax.device_get(state.params))
    np.testing.assert_allclose(float(optax.tree.norm(step_taken)), 0.1, rtol=1e-5)


def test_optimizer_state_is_sharded_one_nth_per_device():
    state, _ = zero_steps(optax.adam(1e-2), [data(N * 2)])
    mu = state.opt_state[0].mu["w1"]
    assert mu.shape == (5, 16)  # the model's shape, split on the axis 8 divides
    assert {s.data.shape for s in mu.addressable_shards} == {(5, 2)}
    assert state.opt_state[0].count.sharding.is_fully_replicated
    assert state.params["w1"].sharding.is_fully_replicated


def test_batchnorm_and_aux_with_sharded_optimizer():
    # SGD, not Adam: the bias before BatchNorm has a zero gradient up to rounding, which Adam
    # would scale up to a full step of noise.
    batch, tx = data(N * 8), optax.sgd(0.1, momentum=0.9)
    state0, ref_stats, ref_params, model = global_batch_reference(batch, tx)

    def loss(params, batch, stats):
        value, new_stats = bn_loss(model)(params, batch, stats)
        return value, ({"twice": 2 * value}, new_stats)

    state = jdp.broadcast(state0, shard_optimizer=True)
    step = jdp.train_step(loss, has_aux=True, shard_optimizer=True)
    state, metrics = step(state, jdp.shard(batch))
    assert_tree_close(jax.device_get(state.params), ref_params, rtol=1e-5, atol=1e-6)
    assert_tree_close(jax.device_get(state.model_state), ref_stats, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["twice"]), 2 * float(metrics["loss"]), rtol=1e-6)


def test_sharded_accumulation_equals_one_step_on_the_whole_batch():
    batches = [data(N * 8, seed=s) for s in range(2)]
    expected = single_device_steps(odd_params(), optax.adam(1e-2), batches, loss=scaled_mse)
    state, _ = zero_steps(optax.adam(1e-2), batches, accum_steps=4)
    assert_tree_close(jax.device_get(state.params), expected, rtol=1e-5, atol=1e-6)


def collective_bytes(hlo: str) -> dict:
    """Bytes of each collective's result in a compiled step's HLO text."""
    import re
    sizes = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1}
    out: dict = {}
    for kind in ("all-reduce", "reduce-scatter", "all-gather"):
        for m in re.finditer(rf"= \(?([a-z0-9]+)\[([0-9,]*)\][^=]*? {kind}(-start)?\(", hlo):
            dims = [int(d) for d in m.group(2).split(",") if d]
            out[kind] = out.get(kind, 0) + sizes.get(m.group(1), 4) * int(np.prod(dims or [1]))
    return out


def test_sharded_step_reduce_scatters_and_all_gathers_instead_of_all_reducing():
    tx = optax.adam(1e-2)
    params = {"w": jnp.ones((64, 32)), "b": jnp.ones((32,))}
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=tx),
                          shard_optimizer=True)

    def loss(p, batch):
        return jnp.mean((batch["x"] @ p["w"] + p["b"]) ** 2)

    batch = jdp.shard({"x": np.ones((N * 2, 64), np.float32)})
    hlo = jdp.train_step(loss, shard_optimizer=True).lower(state, batch).compile().as_text()
    found = collective_bytes(hlo)
    assert found.get("reduce-scatter", 0) >= (64 * 32 + 32) * 4 // N
    assert found.get("all-gather", 0) >= (64 * 32 + 32) * 4
    assert found.get("all-reduce", 0) < 64 * 32 * 4  # only scalars (metrics) are all-reduced


def test_a_replicated_optimizer_state_with_shard_optimizer_is_named():
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=odd_params(),
                                                tx=optax.adam(1e-2)))
    with pytest.raises(ValueError, match=r"broadcast\(state, shard_optimizer=True\)"):
        jdp.train_step(scaled_mse, shard_optimizer=True)(
            state, jdp.shard(data(N * 2)))


def test_a_pmap_form_state_with_shard_optimizer_is_named():
    state = jdp.pmap.replicate(jdp.TrainState.create(apply_fn=None, params=odd_params(),
                                                     tx=optax.adam(1e-2)))
    with pytest.raises(ValueError, match=r"not replicated on jdp.mesh\(\): place the state with "
                                         r"jdp.broadcast\(state\).*jdp.pmap.train_step"):
        jdp.train_step(scaled_mse, shard_optimizer=True)(state, jdp.shard(data(N * 2)))


def test_the_pmap_form_has_no_shard_optimizer():
    with pytest.raises(TypeError, match="shard_optimizer"):
        jdp.pmap.train_step(scaled_mse, shard_optimizer=True)


def test_a_sharded_optimizer_state_with_a_plain_step_is_named():
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=odd_params(),
                                                tx=optax.adam(1e-2)), shard_optimizer=True)
    with pytest.raises(ValueError, match=r"optimizer state is sharded .*pass "
                                         r"shard_optimizer=True to the step too"):
        jdp.train_step(scaled_mse)(state, jdp.shard(data(N * 2)))


def test_unshard_gives_the_optimizer_state_of_unsharded_training():
    """2 Adam steps with and without ZeRO on the same data: the gathered optimizer state is the
    replicated one, unpadded, in the model's shapes, replicated on every device."""
    tx, batches = optax.adam(1e-2), [data(N * 4, seed=s) for s in range(2)]
    zero, _ = zero_steps(tx, batches)
    plain = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=odd_params(), tx=tx))
    step = jdp.train_step(scaled_mse)
    for b in batches:
        plain, _ = step(plain, jdp.shard(b))
    whole = jdp.unshard(zero)
    assert jax.tree.structure(whole.opt_state) == jax.tree.structure(plain.opt_state)
    for got, want in zip(jax.tree.leaves(whole.opt_state), jax.tree.leaves(plain.opt_state),
                         strict=True):
        assert got.shape == want.shape and got.sharding.is_fully_replicated
    assert_tree_close(jax.device_get(whole.opt_state), jax.device_get(plain.opt_state),
                      rtol=1e-5, atol=1e-7)
    assert int(whole.opt_state[0].count) == 2
    assert_tree_close(jax.device_get(whole.params), jax.device_get(plain.params),
                      rtol=1e-5, atol=1e-6)


def test_unshard_of_a_replicated_state_returns_it_as_it_is():
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=odd_params(),
                                                tx=optax.adam(1e-2)))
    assert jdp.unshard(state) is state
