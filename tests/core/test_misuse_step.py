"""Misuse of the steps and the state helpers: each a Python exception at the call whose message
names the offending value and the fix, in both forms; never a crash, a hang or a wrong number."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import one_line_error
from test_step import FORMS, N, data, mlp_params, mse

import jdp


def placed(form, tx=None):
    state = jdp.TrainState.create(apply_fn=None, params=mlp_params(), tx=tx or optax.sgd(0.1))
    return FORMS[form].place(state)


def batch_for(form, n=N * 2):
    return FORMS[form].shard(data(n))


@pytest.mark.parametrize("form", FORMS)
def test_reusing_a_donated_state_is_a_runtime_error_naming_both_fixes(form):
    state, step, batch = placed(form), FORMS[form].train_step(mse), batch_for(form)
    new_state, _ = step(state, batch)
    with pytest.raises(RuntimeError, match=r"donated.*state, metrics = step\(state, batch\).*"
                                           r"donate=False"):
        step(state, batch)
    step(new_state, batch)  # the returned state still works


@pytest.mark.parametrize("form", FORMS)
def test_donate_false_keeps_the_old_state_usable(form):
    state, batch, one = placed(form), batch_for(form), FORMS[form].one
    step = FORMS[form].train_step(mse, donate=False)
    first, _ = step(state, batch)
    second, _ = step(state, batch)
    np.testing.assert_array_equal(one(first).params["w1"], one(second).params["w1"])


def test_unreplicate_of_a_tree_that_was_never_replicated_is_refused():
    with pytest.raises(ValueError, match=r"\['w'\] has shape \(3, 2\).*not replicated"):
        jdp.unreplicate({"w": np.zeros((3, 2))})


def test_unreplicate_of_a_global_tree_returns_it_unchanged():
    tree = jdp.broadcast({"w": np.arange(6.0).reshape(3, 2)})
    np.testing.assert_array_equal(np.asarray(jdp.unreplicate(tree)["w"]),
                                  np.arange(6.0).reshape(3, 2))


def test_unreplicate_of_a_hand_written_pmap_output_takes_device_0():
    out = jax.pmap(lambda x: x * 2, axis_name="devices")(np.arange(N * 3.0).reshape(N, 3))
    np.testing.assert_array_equal(np.asarray(jdp.unreplicate({"w": out})["w"]),
                                  [0.0, 2.0, 4.0])


@pytest.mark.parametrize("value, error", [(0, ValueError), (1000, ValueError), (2.5, TypeError)])
def test_max_in_flight_outside_1_to_16_is_refused_not_left_to_hang(value, error):
    with pytest.raises(error, match=rf"max_in_flight={value}.*1\.\.16"):
        jdp.train_step(mse, max_in_flight=value)


def with_aux(params, batch):
    return mse(params, batch), {"x0": batch["x"][0, 0]}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("loss, has_aux, match", [
    (with_aux, False, r"tuple of 2: with has_aux=False .* must return loss; pass has_aux=True"),
    (mse, True, r"returned a .*with has_aux=True .* must return \(loss, metrics\)"),
])
def test_a_loss_of_the_wrong_form_names_has_aux_and_the_form_expected(form, loss, has_aux,
                                                                      match):
    with pytest.raises(TypeError, match=match):
        FORMS[form].train_step(loss, has_aux=has_aux)(placed(form), batch_for(form))


@pytest.mark.parametrize("has_aux, returns, match", [
    (False, "loss", r"has_aux=False and a model state .* \(loss, new_model_state\)"),
    (True, "pair", r"has_aux=True and a model state .* \(loss, \(metrics, new_model_state\)\)"),
])
def test_a_loss_that_forgets_the_model_state_is_named(has_aux, returns, match):
    def loss_fn(params, batch, model_state):
        loss = mse(params, batch)
        return loss if returns == "loss" else (loss, model_state)

    state = jdp.TrainState.create(apply_fn=None, params=mlp_params(), tx=optax.sgd(0.1),
                                  model_state={"count": jnp.zeros(())})
    with pytest.raises(TypeError, match=match):
        jdp.train_step(loss_fn, has_aux=has_aux)(jdp.broadcast(state), batch_for("global"))


@pytest.mark.parametrize("form", FORMS)
def test_a_forgotten_has_aux_with_model_state_is_named_not_taken_for_the_statistics(form):
    """(loss, (metrics, stats)) without has_aux=True would make (metrics, stats) the new model
    state, and the next step would hand the loss that pair as its statistics."""
    def loss_fn(params, batch, model_state):
        return mse(params, batch), ({"x0": batch["x"][0, 0]}, model_state)

    state = jdp.TrainState.create(apply_fn=None, params=mlp_params(), tx=optax.sgd(0.1),
                                  model_state={"count": jnp.zeros(())})
    with pytest.raises(TypeError, match=r"new model state structured as .*pass has_aux=True"):
        FORMS[form].train_step(loss_fn)(FORMS[form].place(state), batch_for(form))


def test_an_unplaced_state_names_jdp_broadcast_and_the_pmap_forms_step():
    state = jdp.TrainState.create(apply_fn=None, params=mlp_params(), tx=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"place the state with jdp.broadcast\(state\) \(a state "
                                         r"from jdp.replicate, the pmap form, goes with "
                                         r"jdp.pmap.train_step\)"):
        jdp.train_step(mse)(state, batch_for("global"))


def test_a_pmap_form_state_to_the_global_step_is_named():
    one_line_error(ValueError, ["state leaf .step is not replicated on jdp.mesh()",
                                "jdp.broadcast(state)", "jdp.pmap.train_step"],
                   jdp.train_step(mse), placed("pmap"), batch_for("global"))


def test_a_global_state_to_the_pmap_step_is_named():
    one_line_error(ValueError, ["state leaf .step is of shape ()",
                                "jdp.pmap steps take one copy per local device",
                                "jdp.pmap.replicate(state)", "jdp.train_step"],
                   jdp.pmap.train_step(mse), placed("global"), batch_for("pmap"))


def test_shard_optimizer_is_not_an_option_of_the_pmap_form():
    with pytest.raises(TypeError, match="shard_optimizer"):
        jdp.pmap.train_step(mse, shard_optimizer=True)


def test_a_sharded_optimizer_state_to_a_step_without_shard_optimizer_is_named():
    zero = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=mlp_params(),
                                               tx=optax.adam(1e-2)), shard_optimizer=True)
    one_line_error(ValueError, ["optimizer state is sharded",
                                "pass shard_optimizer=True to the step too"],
                   jdp.train_step(mse), zero, batch_for("global"))


def test_broadcast_shard_optimizer_of_a_tree_without_opt_state():
    with pytest.raises(TypeError, match=r"dict has no opt_state.*TrainState"):
        jdp.broadcast({"w": np.zeros(3)}, shard_optimizer=True)


def test_shard_with_an_unknown_layout():
    with pytest.raises(ValueError, match=r"layout='sharded'; expected 'global' \(default\) or "
                                         r"'pmap'"):
        jdp.shard({"x": np.zeros((8, 2))}, layout="sharded")


def test_global_shard_of_rows_the_devices_do_not_divide():
    with pytest.raises(ValueError, match=r"\['x'\] has 12 rows, which the 8 local devices cannot"):
        jdp.shard({"x": np.zeros((12, 5))})


def test_global_batch_leaves_of_different_sizes():
    batch = batch_for("global")
    batch["y"] = jdp.shard(np.zeros((N * 4, 1), np.float32))
    with pytest.raises(ValueError, match=r"\['y'\] has 32 examples but \['x'\] has 16"):
        jdp.train_step(mse)(placed("global"), batch)


@pytest.mark.parametrize("form", FORMS)
def test_an_empty_batch(form):
    with pytest.raises(ValueError, match="batch is empty"):
        FORMS[form].train_step(mse)(placed(form), {})


@pytest.mark.parametrize("form", FORMS)
def test_eval_metric_fn_returning_a_scalar_instead_of_a_dict(form):
    with pytest.raises(TypeError, match=r"metric_fn returned .*expected a dict of per-example"):
        FORMS[form].eval_step(lambda s, b: jnp.mean(b["x"]))(placed(form), batch_for(form))


@pytest.mark.parametrize("form", FORMS)
def test_a_loss_that_raises_shows_its_own_error_before_anything_runs(form):
    def broken(params, batch):
        raise KeyError("no field 'image' in this batch")

    state, train_step = placed(form), FORMS[form].train_step
    with pytest.raises(KeyError, match="no field 'image'"):
        train_step(broken)(state, batch_for(form))
    train_step(mse)(state, batch_for(form))  # the state was not donated to the failure


# --- issue 26: placing twice, parameters that cannot be trained, flags, masks -------------------

def plain_state(params=None, tx=None):
    return jdp.TrainState.create(apply_fn=None, params=mlp_params() if params is None else params,
                                 tx=tx or optax.sgd(0.1))


def test_broadcast_of_a_state_already_in_the_pmap_form_is_refused():
    one_line_error(ValueError, ["in the pmap form", "jdp.pmap.unreplicate"],
                   jdp.broadcast, jdp.replicate(plain_state()))


def test_replicate_of_a_replicated_state_is_refused_not_given_a_second_device_axis():
    one_line_error(ValueError, ["already in the pmap form", "jdp.pmap.unreplicate"],
                   jdp.replicate, jdp.replicate(plain_state()))


def test_broadcast_of_a_broadcast_state_is_the_same_state():
    once = jdp.broadcast(plain_state())
    twice = jdp.broadcast(once)
    for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(twice), strict=True):
        assert a.shape == b.shape and b.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("form", FORMS)
def test_an_integer_parameter_leaf_is_named(form):
    params = {**mlp_params(), "count": np.arange(3, dtype=np.int32)}
    state = FORMS[form].place(plain_state(params))
    one_line_error(ValueError, ["parameter leaf ['count'] has dtype int32", "keep integer values "
                                "out of params"], FORMS[form].train_step(mse), state,
                   batch_for(form))


def test_empty_params_say_the_params_are_empty():
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params={}, tx=optax.sgd(0.1)))
    one_line_error(ValueError, ["params are empty", "TrainState.create(params=...)"],
                   jdp.train_step(lambda p, b: jnp.mean(b["x"])), state, batch_for("global"))


@pytest.mark.parametrize("option, error", [("has_aux", TypeError), ("donate", TypeError),
                                           ("shard_optimizer", TypeError),
                                           ("shard_params", ValueError)])   # 1: no group size
def test_flags_that_are_not_bools_are_refused(option, error):
    one_line_error(error, [f"{option}=1", "must be True or False"], jdp.train_step, mse,
                   **{option: 1})


@pytest.mark.parametrize("option", ["has_aux", "donate"])
def test_the_pmap_forms_flags_that_are_not_bools_are_refused(option):
    one_line_error(TypeError, [f"{option}='yes'", "must be True or False", "not a str"],
                   jdp.pmap.train_step, mse, **{option: "yes"})


@pytest.mark.parametrize("form", FORMS)
def test_an_eval_mask_that_is_not_boolean_is_refused(form):
    rows = {**data(N * 2), "mask": np.linspace(0, 1, N * 2).astype(np.float32)}
    state = placed(form)
    evaluate = FORMS[form].eval_step(lambda s, b: {"x": b["x"][:, 0]})
    one_line_error(TypeError, ["batch['mask'] has dtype float32", "mask.astype(bool)"], evaluate,
                   state, FORMS[form].shard(rows))


@pytest.mark.parametrize("value", [jnp.int8, jnp.int32, "bool"])
def test_comm_dtype_that_is_not_floating_is_refused(value):
    one_line_error(ValueError, ["comm_dtype=", "expected a floating dtype"], jdp.train_step, mse,
                   comm_dtype=value)


@pytest.mark.parametrize("who", ["jdp.broadcast", "jdp.shard", "jdp.train_step"])
def test_the_core_refuses_a_launched_job_that_was_never_joined(monkeypatch, who):
    from jdp.job import rank
    state, batch, step = placed("global"), batch_for("global"), jdp.train_step(mse)
    calls = {"jdp.broadcast": lambda: jdp.broadcast(plain_state()),
             "jdp.shard": lambda: jdp.shard(data(N)), "jdp.train_step": lambda: step(state, batch)}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(rank.current().agreement, "job_checked", False)
    with pytest.raises(RuntimeError) as info:
        calls[who]()
    assert f"{who}: this process runs under a launcher (WORLD_SIZE=2" in str(info.value)
    assert "call jdp.initialize() first in main" in str(info.value)
