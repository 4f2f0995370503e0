"""Bad input to the parallel steps fails before anything runs, with one clear line naming the
value and the fix, in both forms (jdp.train_step and jdp.pmap.train_step)."""
import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import one_line_error
from test_step import FORMS, N, data, mlp_params, mse

import jdp


def placed(form):
    return FORMS[form].place(jdp.TrainState.create(apply_fn=None, params=mlp_params(),
                                                   tx=optax.sgd(0.1)))


def test_pmap_batch_leading_axis_not_the_device_count():
    batch = data(N * 2)  # [16, ...], not [8, 2, ...]
    one_line_error(ValueError, ["['x'] has shape (16, 5)", "[8, per_device_batch, ...]",
                                "jdp.pmap.shard(rows)"],
                   jdp.pmap.train_step(mse), placed("pmap"), batch)


def test_global_batch_the_devices_do_not_divide():
    one_line_error(ValueError, ["['x'] has shape (12, 5)", "over 8 devices", "multiple of 8"],
                   jdp.train_step(mse), placed("global"), data(12))


@pytest.mark.parametrize("form, words", [
    ("global", ["['y'] has 24 examples but ['x'] has 16", "same batch size"]),
    ("pmap", ["['y'] has 3 examples per device but ['x'] has 2", "same per-device batch"]),
])
def test_leaves_with_unequal_batch_sizes(form, words):
    f = FORMS[form]
    batch = f.shard(data(N * 2))
    batch["y"] = f.shard(np.zeros((N * 3, 1), np.float32))
    one_line_error(ValueError, words, f.train_step(mse), placed(form), batch)


@pytest.mark.parametrize("form, match", [
    ("global", r"state leaf \.step is a int of shape \(\), not a global array on jdp.mesh\(\): "
               r"place the state with jdp.broadcast\(state\)"),
    ("pmap", r"state leaf \.step is of shape \(\): jdp.pmap steps take one copy per local "
             r"device .*jdp.pmap.replicate\(state\)"),
])
def test_unplaced_state_is_named(form, match):
    plain = jdp.TrainState.create(apply_fn=None, params=mlp_params(), tx=optax.sgd(0.1))
    f = FORMS[form]
    with pytest.raises(ValueError, match=match):
        f.train_step(mse)(plain, f.shard(data(N * 2)))


@pytest.mark.parametrize("form", FORMS)
def test_non_scalar_loss(form):
    def per_example(params, batch):
        return jnp.sum((batch["x"] @ params["w1"]) ** 2, axis=1)

    f = FORMS[form]
    with pytest.raises(ValueError, match=r"loss of shape \(2,\): expected a scalar.*jnp.mean"):
        f.train_step(per_example)(placed(form), f.shard(data(N * 2)))


@pytest.mark.parametrize("form, match", [
    ("global", r"\['x'\] has shape \(16, 5\).*accum_steps=4.*multiple of 32"),
    ("pmap", r"per-device batch 2 is not divisible by accum_steps=4"),
])
def test_accum_steps_must_divide_the_per_device_batch(form, match):
    f = FORMS[form]
    with pytest.raises(ValueError, match=match):
        f.train_step(mse, accum_steps=4)(placed(form), f.shard(data(N * 2)))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("options, error, words", [
    ({"grad_reduce": "avg"}, ValueError, ["grad_reduce='avg'", "'mean'"]),
    ({"accum_steps": 0}, ValueError, ["accum_steps=0", "int >= 1"]),
    ({"accum_steps": True}, TypeError, ["accum_steps=True", "int >= 1", "not a bool"]),
    ({"max_in_flight": True}, TypeError, ["max_in_flight=True", "int in 1..16", "not a bool"]),
    ({"model_state_sync": "max"}, ValueError,
     ["model_state_sync='max'", "nn.BatchNorm(axis_name=jdp.AXIS)"]),
    ({"comm_dtype": jnp.int8}, ValueError,
     [f"comm_dtype={jnp.int8!r}", "floating dtype", "jnp.bfloat16"]),
], ids=["grad_reduce", "accum_steps", "accum_steps_bool", "max_in_flight_bool",
        "model_state_sync", "comm_dtype_int8"])
def test_bad_options_are_refused_when_the_step_is_made(options, error, words, form):
    one_line_error(error, words, FORMS[form].train_step, mse, **options)


@pytest.mark.parametrize("form", FORMS)
def test_the_removed_backend_option_is_an_unexpected_keyword(form):
    """backend= chose how the stacked form ran; each form now has its own step."""
    with pytest.raises(TypeError, match=re.escape("unexpected keyword argument 'backend'")):
        FORMS[form].train_step(mse, backend="xla")


@pytest.mark.parametrize("shard", [jdp.shard, jdp.pmap.shard], ids=["global", "pmap"])
def test_shard_names_rows_the_devices_do_not_divide(shard):
    with pytest.raises(ValueError, match=r"\['x'\] has 12 rows, which the 8 local devices"):
        shard({"x": np.zeros((12, 5))})


@pytest.mark.parametrize("form", FORMS)
def test_eval_metric_fn_must_return_per_example_values(form):
    def mean_only(state, batch):
        return {"err": jnp.mean(batch["x"])}

    f = FORMS[form]
    with pytest.raises(ValueError, match=r"'err' has shape \(\): expected per-example"):
        f.eval_step(mean_only)(placed(form), f.shard(data(N * 2)))
