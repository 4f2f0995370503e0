"""Two silent wrong answers made one-line errors: a metric named "count" (the example count's
name) in `jdp.eval_step` / `jdp.evaluate`, and `model_state_sync=None` with a model state that
is not one value on every device (replicated, ZeRO, FSDP and HSDP)."""
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import one_line_error
from jax import lax

import jdp

N = 8


def counting_metric(state, batch):
    return {"count": batch["x"] > 0, "sq": batch["x"] ** 2}


def test_a_metric_named_count_is_refused_by_eval_step_and_evaluate():
    state, x = jdp.broadcast({"w": np.float32(1)}), np.arange(1, 2 * N + 1, dtype=np.float32)
    one_line_error(ValueError, ["'count'", "rename"], jdp.eval_step(counting_metric), state,
                   jdp.shard({"x": x}))
    one_line_error(ValueError, ["'count'", "rename"], jdp.evaluate, counting_metric, state,
                   {"x": x})


def ms_loss(synced):
    """A loss whose model state adds up batch means of x: "a" the global batch's (averaged over
    the devices in the forward pass, as BatchNorm(axis_name=)), "m" each device's own unless
    `synced`."""
    def loss(params, batch, ms):
        mean = jnp.mean(batch["x"])
        new = {"a": ms["a"] + lax.pmean(mean, jdp.AXIS),
               "m": ms["m"] + (lax.pmean(mean, jdp.AXIS) if synced else mean)}
        return jnp.mean((batch["x"] @ params["w"]) ** 2), new
    return loss


def ms_state(**layout):
    return jdp.broadcast(jdp.TrainState.create(
        apply_fn=None, params={"w": np.ones((3, 5), np.float32)}, tx=optax.sgd(0.1),
        model_state={"a": np.zeros((), np.float32), "m": np.zeros((), np.float32)}), **layout)


LAYOUTS = [{}, {"shard_optimizer": True}, {"shard_params": True}, {"shard_params": 4}]
IDS = ["replicated", "zero", "fsdp", "hsdp4"]
X = np.arange(N * 2 * 3, dtype=np.float32).reshape(N * 2, 3)


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_model_state_sync_none_with_a_per_device_model_state_is_refused(layout):
    step = jdp.train_step(ms_loss(synced=False), model_state_sync=None, **layout)
    one_line_error(ValueError, ["model_state_sync=None", "model_state['m']",
                                "model_state_sync='mean'", "axis_name=jdp.AXIS"],
                   step, ms_state(**layout), jdp.shard({"x": X}))


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_the_steps_first_half_refuses_a_per_device_model_state_as_the_step_does(layout):
    """`step.gradients` (what jdp.ft runs) checks as the whole step does, and its metrics
    are the loss alone when the model state agrees."""
    for synced in (False, True):
        step = jdp.train_step(ms_loss(synced=synced), model_state_sync=None, **layout)
        args = ms_state(**layout), jdp.shard({"x": X})
        if not synced:
            one_line_error(ValueError, ["model_state_sync=None", "model_state['m']"],
                           step.gradients, *args)
            continue
        _, new_ms, metrics = step.gradients(*args)
        assert sorted(metrics) == ["loss"], metrics
        np.testing.assert_allclose(float(new_ms["m"]), X.mean(), rtol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_model_state_sync_none_with_a_model_state_synced_in_the_forward_pass_trains(layout):
    step = jdp.train_step(ms_loss(synced=True), model_state_sync=None, **layout)
    state = ms_state(**layout)
    for _ in range(2):
        state, _ = step(state, jdp.shard({"x": X}))
    for leaf in ("a", "m"):
        np.testing.assert_allclose(float(state.model_state[leaf]), 2 * X.mean(), rtol=1e-6)
