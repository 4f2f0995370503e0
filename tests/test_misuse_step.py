"""Misuse of the steps and the state helpers: each a Python exception at the call whose message
names the offending value and the fix, on both layouts; never a crash, a hang or a wrong number."""
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_step import N, data, mlp_params, mse

import jdp

LAYOUTS = {"global": jdp.broadcast, "pmap": jdp.replicate}


def placed(layout, tx=None):
    state = jdp.TrainState.create(apply_fn=None, params=mlp_params(), tx=tx or optax.sgd(0.1))
    return LAYOUTS[layout](state)


def batch_for(layout, n=N * 2):
    return jdp.shard(data(n), layout=layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reusing_a_donated_state_is_a_runtime_error_naming_both_fixes(layout):
    state, step, batch = placed(layout), jdp.train_step(mse), batch_for(layout)
    new_state, _ = step(state, batch)
    with pytest.raises(RuntimeError, match=r"donated.*state, metrics = step\(state, batch\).*"
                                           r"donate=False"):
        step(state, batch)
    step(new_state, batch)  # the returned state still works


@pytest.mark.parametrize("layout", LAYOUTS)
def test_donate_false_keeps_the_old_state_usable(layout):
    state, batch = placed(layout), batch_for(layout)
    step = jdp.train_step(mse, donate=False)
    first, _ = step(state, batch)
    second, _ = step(state, batch)
    np.testing.assert_array_equal(np.asarray(jdp.unreplicate(first).params["w1"]),
                                  np.asarray(jdp.unreplicate(second).params["w1"]))


def test_unreplicate_of_a_tree_that_was_never_replicated_is_refused():
    with pytest.raises(ValueError, match=r"\['w'\] has shape \(3, 2\).*not replicated"):
        jdp.unreplicate({"w": np.zeros((3, 2))})


def test_unreplicate_of_a_global_tree_returns_it_unchanged():
    tree = jdp.broadcast({"w": np.arange(6.0).reshape(3, 2)})
    np.testing.assert_array_equal(np.asarray(jdp.unreplicate(tree)["w"]),
                                  np.arange(6.0).reshape(3, 2))


@pytest.mark.parametrize("value", [0, 1000, 2.5])
def test_max_in_flight_outside_1_to_16_is_refused_not_left_to_hang(value):
    with pytest.raises(ValueError, match=rf"max_in_flight={value}.*1\.\.16"):
        jdp.train_step(mse, max_in_flight=value)


def with_aux(params, batch):
    return mse(params, batch), {"x0": batch["x"][0, 0]}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("loss, has_aux, match", [
    (with_aux, False, r"tuple of 2: with has_aux=False .* must return loss; pass has_aux=True"),
    (mse, True, r"returned a .*with has_aux=True .* must return \(loss, metrics\)"),
])
def test_a_loss_of_the_wrong_form_names_has_aux_and_the_form_expected(layout, loss, has_aux,
                                                                      match):
    with pytest.raises(TypeError, match=match):
        jdp.train_step(loss, has_aux=has_aux)(placed(layout), batch_for(layout))


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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_forgotten_has_aux_with_model_state_is_named_not_taken_for_the_statistics(layout):
    """(loss, (metrics, stats)) without has_aux=True would make (metrics, stats) the new model
    state, and the next step would hand the loss that pair as its statistics."""
    def loss_fn(params, batch, model_state):
        return mse(params, batch), ({"x0": batch["x"][0, 0]}, model_state)

    state = jdp.TrainState.create(apply_fn=None, params=mlp_params(), tx=optax.sgd(0.1),
                                  model_state={"count": jnp.zeros(())})
    with pytest.raises(TypeError, match=r"new model state structured as .*pass has_aux=True"):
        jdp.train_step(loss_fn)(LAYOUTS[layout](state), batch_for(layout))


def test_an_unplaced_state_names_both_ways_to_place_it():
    state = jdp.TrainState.create(apply_fn=None, params=mlp_params(), tx=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"jdp.replicate\(state\).*jdp.broadcast\(state\)"):
        jdp.train_step(mse)(state, batch_for("global"))


def test_shard_optimizer_on_the_pmap_layout_is_refused():
    with pytest.raises(ValueError, match="shard_optimizer=True needs the global layout"):
        jdp.train_step(mse, shard_optimizer=True)(placed("pmap"), batch_for("pmap"))


def test_broadcast_shard_optimizer_of_a_tree_without_opt_state():
    with pytest.raises(TypeError, match=r"dict has no opt_state.*TrainState"):
        jdp.broadcast({"w": np.zeros(3)}, shard_optimizer=True)


def test_shard_with_an_unknown_layout():
    with pytest.raises(ValueError, match=r"layout='sharded'.*'pmap' or 'global'"):
        jdp.shard({"x": np.zeros((8, 2))}, layout="sharded")


def test_global_shard_of_rows_the_devices_do_not_divide():
    with pytest.raises(ValueError, match=r"\['x'\] has shape \(12, 5\).*divisible by the 8"):
        jdp.shard({"x": np.zeros((12, 5))}, layout="global")


def test_global_batch_leaves_of_different_sizes():
    batch = batch_for("global")
    batch["y"] = jdp.shard(np.zeros((N * 4, 1), np.float32), layout="global")
    with pytest.raises(ValueError, match=r"\['y'\] has 32 examples but \['x'\] has 16"):
        jdp.train_step(mse)(placed("global"), batch)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_empty_batch(layout):
    with pytest.raises(ValueError, match="batch is empty"):
        jdp.train_step(mse)(placed(layout), {})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_eval_metric_fn_returning_a_scalar_instead_of_a_dict(layout):
    with pytest.raises(TypeError, match=r"metric_fn returned .*expected a dict of per-example"):
        jdp.eval_step(lambda s, b: jnp.mean(b["x"]))(placed(layout), batch_for(layout))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_loss_that_raises_shows_its_own_error_before_anything_runs(layout):
    def broken(params, batch):
        raise KeyError("no field 'image' in this batch")

    state = placed(layout)
    with pytest.raises(KeyError, match="no field 'image'"):
        jdp.train_step(broken)(state, batch_for(layout))
    jdp.train_step(mse)(state, batch_for(layout))  # the state was not donated to the failure
