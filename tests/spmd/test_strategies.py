"""The SPMD floor alone: each storage strategy's two halves, called directly under `jax.jit`
with no job, no step object and no dispatch (nothing of `jdp.core`), train exactly as
single-device optax on the global batch. What makes the floor testable on its own."""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdp.spmd import mesh as spmd_mesh
from jdp.spmd import storage, strategies

N = 8


@dataclasses.dataclass(frozen=True)
class Options:
    """The options a strategy reads (what `jdp.core.StepOptions` holds), written out here."""
    loss_fn: Any
    accum_steps: int = 1
    shard_optimizer: bool = False
    shard_params: Any = False
    has_aux: bool = False
    model_state_sync: Any = "mean"
    mean: bool = True
    comm_dtype: Any = None
    compute_dtype: Any = None
    cast_batch: bool = True

    def loss_options(self) -> dict:
        return {"loss_fn": self.loss_fn, "has_aux": self.has_aux,
                "accum_steps": self.accum_steps, "model_state_sync": self.model_state_sync}


def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def host_values():
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(4, 16)).astype(np.float32),
              "b1": np.zeros(16, np.float32),
              "w2": rng.normal(size=(16, 1)).astype(np.float32)}
    batch = {"x": rng.normal(size=(4 * N, 4)).astype(np.float32),
             "y": rng.normal(size=(4 * N, 1)).astype(np.float32)}
    return params, batch


def placed_state(params, tx, options):
    """The state stored as the strategy keeps it: whole, or split (ZeRO, FSDP)."""
    host = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    whole = jax.tree.map(lambda x: spmd_mesh.place(np.asarray(x), spmd_mesh.replicated()), host)
    if options.shard_params:
        return whole.replace(params=storage.place_split(host.params),
                             opt_state=storage.place_split(host.opt_state))
    if options.shard_optimizer:
        return whole.replace(opt_state=storage.place_split(host.opt_state, fsdp=False))
    return whole


@pytest.mark.parametrize("kind", ["replicated", "zero", "fsdp"])
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_each_strategy_called_alone_trains_as_one_device_on_the_global_batch(kind, accum_steps):
    assert jax.device_count() == N
    options = Options(loss_fn, accum_steps=accum_steps, shard_optimizer=kind == "zero",
                      shard_params=kind == "fsdp")
    strategy = strategies.of(options)
    assert type(strategy).__name__ == {"replicated": "Replicated", "zero": "Zero",
                                       "fsdp": "Fsdp"}[kind]
    params, batch = host_values()
    tx = optax.adam(1e-2)
    state = placed_state(params, tx, options)
    rows = jax.tree.map(lambda x: spmd_mesh.place(x, spmd_mesh.batch_sharded()), batch)
    stop = jax.device_put(jnp.zeros(N, jnp.int32), NamedSharding(spmd_mesh.mesh(), P("batch")))

    @jax.jit
    def step(state, batch, stop):
        grads, new_ms, metrics = strategy.gradients(state, batch, stop)
        return strategy.update(state, grads, new_ms), metrics

    want_params, want_opt = params, tx.init(params)
    for _ in range(3):
        loss, grads = jax.value_and_grad(loss_fn)(want_params, batch)
        updates, want_opt = tx.update(grads, want_opt, want_params)
        want_params = optax.apply_updates(want_params, updates)
        state, metrics = step(state, rows, stop)
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    for name, want in want_params.items():
        got = state.params[name]
        assert got.shape == want.shape   # stored split or whole, always the model's shape
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_the_one_accumulation_loop_averages_its_micro_batches_and_threads_the_state():
    """`grads.accumulate` directly: the gradient the mean over the k micro-batches, the model
    state passed through them in order, each one's loss and metrics stacked, seeded or from
    zeros alike."""
    from jdp.spmd import grads

    values = jnp.arange(1.0, 5.0)

    def once(i, count):
        g = {"w": values[i] * 2.0}
        return values[i], {"m": values[i] * 10}, g, count + 1

    for zeros in (None, {"w": jnp.zeros(())}):
        g, count, losses, metrics = grads.accumulate(once, 4, jnp.int32(0), zeros=zeros)
        assert float(g["w"]) == pytest.approx(5.0)      # mean of 2, 4, 6, 8
        assert int(count) == 4
        np.testing.assert_array_equal(losses, values)   # each micro-batch's, in order
        np.testing.assert_array_equal(metrics["m"], values * 10)
