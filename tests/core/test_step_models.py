"""train_step with flax linen BatchNorm, flax NNX, dropout RNG, and a hand-written pmap step,
in both forms (global and pmap) where both hold the model's state."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_step import FORMS, N, assert_tree_close, data, mlp_params, mse

import jdp


class BNNet(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name=self.axis_name)(x)
        return nn.Dense(1)(nn.relu(x))


def bn_loss(model):
    def loss_fn(params, batch, batch_stats):
        out, updates = model.apply({"params": params, "batch_stats": batch_stats}, batch["x"],
                                   mutable=["batch_stats"])
        return jnp.mean((out - batch["y"]) ** 2), updates["batch_stats"]
    return loss_fn


def bn_state(model, x, tx):
    v = model.init(jax.random.key(0), x[:2])
    return jdp.TrainState.create(apply_fn=model.apply, params=v["params"], tx=tx,
                                 model_state=v["batch_stats"])


def global_batch_reference(batch, tx):
    """(state0, reference statistics, reference parameters) of one step of plain flax and
    optax on one device over the whole global batch; and the SyncBatchNorm model to test."""
    ref_model = BNNet()
    state0 = bn_state(ref_model, batch["x"], tx)
    (_, ref_stats), grads = jax.value_and_grad(bn_loss(ref_model), has_aux=True)(
        state0.params, batch, state0.model_state)
    ref_params = optax.apply_updates(state0.params, tx.update(grads, tx.init(state0.params))[0])
    return state0, ref_stats, ref_params, BNNet(axis_name=jdp.AXIS)


@pytest.mark.parametrize("form", FORMS)
def test_sync_batchnorm_statistics_equal_those_of_the_global_batch(form):
    f, batch, tx = FORMS[form], data(N * 4), optax.sgd(0.1)
    state0, ref_stats, ref_params, model = global_batch_reference(batch, tx)
    state, _ = f.train_step(bn_loss(model))(f.place(state0), f.shard(batch))
    out = f.one(state)
    assert_tree_close(out.model_state, ref_stats, rtol=1e-5, atol=1e-6)
    assert_tree_close(out.params, ref_params, rtol=1e-5, atol=1e-6)


def per_device_stats(model, state0, batch):
    """Independent: each device's BatchNorm update from its own slice, by plain flax."""
    per_device = [jax.tree.map(lambda v, d=d: v.reshape(N, -1, *v.shape[1:])[d], batch)
                  for d in range(N)]
    return [bn_loss(model)(state0.params, b, state0.model_state)[1] for b in per_device]


def model_state_per_device(form, model_state):
    """Each device's copy of the model state, as host values, in device order."""
    if form == "pmap":
        return [jax.tree.map(lambda v, d=d: np.asarray(v)[d], model_state) for d in range(N)]
    devices = jdp.mesh().devices.flat
    return [jax.tree.map(lambda v, d=d: np.asarray(
        next(s.data for s in v.addressable_shards if s.device == d)), model_state)
        for d in devices]


@pytest.mark.parametrize("form, sync", [("global", "mean"), ("pmap", "mean"), ("pmap", None)])
def test_model_state_sync_mean_leaves_every_device_the_average(form, sync):
    """The global form holds one replicated model state, so only "mean" applies there."""
    f, batch, model = FORMS[form], data(N * 4), BNNet()
    state0 = bn_state(model, batch["x"], optax.sgd(0.1))
    state, _ = f.train_step(bn_loss(model), model_state_sync=sync)(f.place(state0),
                                                                   f.shard(batch))
    expected = per_device_stats(model, state0, batch)
    got = model_state_per_device(form, state.model_state)
    for d in range(N):
        want = (jax.tree.map(lambda *xs: np.mean(xs, 0), *expected) if sync == "mean"
                else expected[d])
        assert_tree_close(got[d], want, rtol=1e-5, atol=1e-6)


def test_dropout_masks_differ_across_devices_and_reproduce_on_rerun():
    def loss_fn(params, batch, keep, rng):
        mask = jax.random.bernoulli(rng, 0.5, (16,))
        return mse(params, batch), {"mask": mask.astype(jnp.float32)}

    def run(seed, form="pmap", sync=None):
        f = FORMS[form]
        state = jdp.TrainState.create(apply_fn=None, params=mlp_params(), tx=optax.sgd(0.0),
                                      model_state={"mask": jnp.zeros(16)}, seed=seed)
        step = f.train_step(loss_fn, model_state_sync=sync)
        state = f.place(state)
        masks = []
        for _ in range(2):
            state, _ = step(state, f.shard(data(N * 2)))
            masks.append(np.asarray(state.model_state["mask"]))
        return masks

    first, again, other = run(0), run(0), run(1)
    # Same keys in either form: the global form's (replicated) mean of the devices' masks.
    np.testing.assert_allclose(run(0, "global", "mean")[1], first[1].mean(0), rtol=1e-6)
    assert len({m.tobytes() for m in first[0]}) == N          # one mask per device
    assert not np.array_equal(first[0], first[1])             # a new mask each step
    np.testing.assert_array_equal(first[0], again[0])         # same seed: same masks
    np.testing.assert_array_equal(first[1], again[1])
    assert not np.array_equal(first[0], other[0])


class NNXNet(nnx.Module):
    def __init__(self, axis_name, rngs):
        self.dense = nnx.Linear(5, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, axis_name=axis_name, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.bn(self.dense(x))))


@pytest.mark.parametrize("form", FORMS)
def test_flax_nnx_model_through_split_and_merge_matches_single_device(form):
    # SGD, not Adam: the Dense bias before BatchNorm has a zero gradient up to rounding, which
    # Adam would blow up to full-size steps of either sign.
    f, batch, tx = FORMS[form], data(N * 4), optax.sgd(0.1, momentum=0.9)
    graphdef, params, rest = nnx.split(NNXNet(jdp.AXIS, nnx.Rngs(0)), nnx.Param, ...)

    def loss_fn(params, batch, rest):
        model = nnx.merge(graphdef, params, rest, copy=True)
        loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
        return loss, nnx.split(model, nnx.Param, ...)[2]

    state = jdp.TrainState.create(apply_fn=None, params=params, tx=tx, model_state=rest)
    state, _ = f.train_step(loss_fn)(f.place(state), f.shard(batch))
    # Reference: the same model without axis name, one device, the global batch.
    ref = NNXNet(None, nnx.Rngs(0))
    optimizer = nnx.Optimizer(ref, tx, wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(ref)
    optimizer.update(ref, grads)
    out = f.one(state)
    assert_tree_close(out.params, nnx.state(ref, nnx.Param), rtol=1e-5, atol=1e-6)
    assert_tree_close(out.model_state, nnx.state(ref, nnx.BatchStat), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mean", [True, False])
def test_hand_written_pmap_with_reduce_gradients_equals_train_step(mean, form):
    f, tx = FORMS[form], optax.adam(1e-2)
    rows = [data(N * 4, seed=s) for s in range(3)]

    @functools.partial(jax.pmap, axis_name="devices")
    def hand_step(params, opt_state, batch):
        grads = jdp.reduce_gradients(jax.grad(mse)(params, batch), axis_name="devices", mean=mean)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = jdp.pmap.replicate(mlp_params())
    opt_state = jdp.pmap.replicate(tx.init(mlp_params()))
    state = f.place(jdp.TrainState.create(apply_fn=None, params=mlp_params(), tx=tx))
    step = f.train_step(mse, grad_reduce="mean" if mean else "sum")
    for r in rows:
        params, opt_state = hand_step(params, opt_state, jdp.pmap.shard(r))
        state, _ = step(state, f.shard(r))
    device_0 = jax.tree.map(lambda x: np.asarray(x)[0], params)
    assert_tree_close(f.one(state).params, device_0, rtol=1e-6, atol=1e-6)
