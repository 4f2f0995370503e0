"""A tree's form (global arrays or the classic pmap form) is known from where jdp placed it,
never guessed from a leading axis that happens to equal the device count: every leaf size from
1 to 2N rows, in every form, survives save/restore and unreplicate; a tree that could be
either is a one-line error."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import one_line_error
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jdp
from jdp.checkpoint import Checkpointer

N = jax.local_device_count()
# Leaves of every row count from 1 to 2N, N rows among them (split one row per device under
# FSDP/ZeRO: the shape of a stacked tree); jdp 0.6 padded those of up to N rows to N, and a
# tree of those alone was taken for the pmap form and cut to one row.
GROUPS = {"1..N": range(1, N + 1), "N+1..2N": range(N + 1, 2 * N + 1)}


def values(group="1..N"):
    """One leaf per row count of the group, every value distinct (so a copied row shows)."""
    return {f"r{r:02d}": np.arange(r * 2, dtype=np.float32).reshape(r, 2) + 100 * r
            for r in GROUPS[group]}


def zeros(group):
    return {k: np.zeros_like(v) for k, v in values(group).items()}


def fsdp(tree):
    """A state whose parameters are sharded (FSDP)."""
    state = jdp.TrainState.create(apply_fn=None, params=tree, tx=optax.sgd(0.1))
    return jdp.broadcast(state, shard_params=True)


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.mark.parametrize("group", GROUPS)
def test_fsdp_params_of_every_size_save_and_restore_every_row(tmp_path, group):
    # The reported loss: w (2, 1) padded to N rows was taken for the pmap form, device 0's row
    # saved, and restore gave [[2], [2]] for [[2], [3]].
    params = fsdp(values(group)).params
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, params)
    restored = ckpt.restore(fsdp(zeros(group)).params)
    got = host(restored)
    for name, want in values(group).items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)


@pytest.mark.parametrize("group", GROUPS)
def test_a_whole_fsdp_state_of_every_size_restores_into_a_replicated_one(tmp_path, group):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, fsdp(values(group)))
    template = jdp.broadcast(jdp.TrainState.create(
        apply_fn=None, params=zeros(group),
        tx=optax.sgd(0.1)))
    got = host(ckpt.restore(template).params)
    for name, want in values(group).items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def zero(trace):
    """A ZeRO state (shard_optimizer) whose momentum is `trace`: its leaf of N rows is split
    one row per device, the shape of a stacked leaf."""
    tx = optax.sgd(0.1, momentum=0.9)
    params = {k: np.zeros_like(v) for k, v in trace.items()}
    state = jdp.TrainState.create(apply_fn=None, params=params, tx=tx)
    state = state.replace(opt_state=(optax.TraceState(trace=trace), optax.EmptyState()))
    return jdp.broadcast(state, shard_optimizer=True)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("what", ["opt_state", "state"])
def test_zero_momentum_of_every_size_saves_and_restores_every_row(tmp_path, what, group):
    saved = zero(values(group))
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, saved.opt_state if what == "opt_state" else saved)
    template = zero(zeros(group))
    if what == "opt_state":
        restored = template.replace(opt_state=ckpt.restore(template.opt_state))
    else:
        restored = ckpt.restore(template)
    got = host(jdp.unshard(restored).opt_state[0].trace)
    same = jax.tree.leaves(jdp.pmap.unreplicate(saved.opt_state))   # global: as it is
    assert all(a is b for a, b in zip(same, jax.tree.leaves(saved.opt_state), strict=True))
    for name, want in values(group).items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("form", ["global", "stacked"])
def test_every_size_round_trips_in_both_forms_and_across_them(tmp_path, form, group):
    place = jdp.broadcast if form == "global" else jdp.pmap.replicate
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, place(values(group)))
    back_global = host(ckpt.restore(jdp.broadcast(zeros(group))))
    back_stacked = ckpt.restore(jdp.pmap.replicate(zeros(group)))
    for name, want in values(group).items():
        np.testing.assert_array_equal(back_global[name], want, err_msg=name)
        assert back_stacked[name].shape == (N, *want.shape), name
        for shard in back_stacked[name].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data)[0], want, err_msg=name)


@pytest.mark.parametrize("group", GROUPS)
def test_unreplicate_returns_global_trees_of_every_size_unchanged(group):
    tree = jdp.broadcast(values(group))
    got = jdp.pmap.unreplicate(tree)
    for name, want in values(group).items():
        assert got[name] is tree[name], name
        np.testing.assert_array_equal(np.asarray(got[name]), want, err_msg=name)


@pytest.mark.parametrize("group", GROUPS)
def test_unreplicate_leaves_fsdp_parameters_whole(group):
    params = fsdp(values(group)).params
    got = host(jdp.pmap.unreplicate(params))
    for name, want in values(group).items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)


@pytest.mark.parametrize("per_device", [1, 2])
def test_unreplicate_of_a_global_batch_of_n_rows_is_the_batch_not_its_first_row(per_device):
    rows = np.arange(N * per_device * 3.0).reshape(N * per_device, 3)
    got = jdp.pmap.unreplicate({"x": jdp.shard(rows)})
    np.testing.assert_array_equal(np.asarray(got["x"]), rows)


@pytest.mark.parametrize("group", GROUPS)
def test_unreplicate_of_every_stacked_size_is_one_copy(group):
    got = jdp.pmap.unreplicate(jdp.pmap.replicate(values(group)))
    for name, want in values(group).items():
        np.testing.assert_array_equal(np.asarray(got[name]), want, err_msg=name)


def test_a_pmap_steps_output_stays_in_the_pmap_form_and_is_saved_as_one_copy(tmp_path):
    w0 = np.array([[0.5], [-1.0]], np.float32)
    x = np.arange(N * 2 * 2, dtype=np.float32).reshape(N * 2, 2) / 10
    y = np.ones((N * 2, 1), np.float32)
    state = jdp.pmap.replicate(jdp.TrainState.create(apply_fn=None, params={"w": w0},
                                                     tx=optax.sgd(0.1)))
    step = jdp.pmap.train_step(lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2))
    state, metrics = step(state, jdp.pmap.shard({"x": x, "y": y}))
    want = w0 - 0.1 * (2 / len(x)) * x.T @ (x @ w0 - y)   # SGD on the mean squared error
    assert jdp.pmap.is_stacked(state) and jdp.pmap.is_stacked(metrics)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, state)
    template = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params={"w": np.zeros_like(w0)},
                                                   tx=optax.sgd(0.1)))
    restored = ckpt.restore(template)
    np.testing.assert_allclose(np.asarray(restored.params["w"]), want, rtol=1e-5)
    assert int(restored.step) == 1


def own_mesh_array(rows_per_device=1):
    """A global array on a mesh of the user's own (not jdp's), one row per local device: it is
    what a hand-written jax.pmap returns, and what `jax.device_put` on your own mesh makes."""
    mesh = Mesh(np.array(jax.local_devices()), ("data",))
    return jax.device_put(np.arange(N * rows_per_device, dtype=np.float32),
                          NamedSharding(mesh, PartitionSpec("data")))


@pytest.mark.parametrize("call", ["save", "broadcast", "replicate"])
def test_a_leaf_that_could_be_either_form_is_a_one_line_error_naming_it(tmp_path, call):
    tree = {"w": own_mesh_array()}
    fn = {"save": lambda t: Checkpointer(tmp_path).save(1, t), "broadcast": jdp.broadcast,
          "replicate": jdp.pmap.replicate}[call]
    one_line_error(ValueError, ["['w']", "form is unknown", "jdp.pmap.replicate",
                                "jdp.broadcast"], fn, tree)


def test_a_leaf_on_your_own_mesh_with_other_row_counts_is_global_and_saved_whole(tmp_path):
    tree = {"w": own_mesh_array(rows_per_device=2)}
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, tree)
    got = ckpt.restore(jdp.broadcast({"w": np.zeros(2 * N, np.float32)}))
    np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(2 * N, dtype=np.float32))


def test_a_tree_mixing_both_forms_is_a_one_line_error_naming_one_leaf_of_each(tmp_path):
    tree = {"a": jdp.pmap.replicate({"w": np.ones(3)})["w"], "b": jdp.broadcast(np.ones(3))}
    one_line_error(ValueError, ["mixes", "['a']", "['b']"], Checkpointer(tmp_path).save, 1, tree)


def test_unshard_of_a_stacked_state_says_to_unreplicate():
    state = jdp.pmap.replicate(jdp.TrainState.create(
        apply_fn=None, params={"w": np.ones((N, 1))}, tx=optax.adam(0.1)))
    one_line_error(ValueError, ["jdp.unshard", "pmap form", "jdp.pmap.unreplicate"],
                   jdp.unshard, state)


def test_the_global_step_refuses_a_stacked_state_by_its_placement():
    state = jdp.pmap.replicate(jdp.TrainState.create(
        apply_fn=None, params={"w": np.ones((2, 1))}, tx=optax.sgd(0.1)))
    step = jdp.train_step(lambda p, b: jnp.mean(b["x"] @ p["w"]))
    one_line_error(ValueError, ["pmap form", "jdp.broadcast", "jdp.pmap.train_step"], step, state,
                   jdp.shard({"x": np.ones((N, 2), np.float32)}))


def test_the_pmap_step_refuses_an_fsdp_state_whose_leaves_have_n_rows():
    state = fsdp({"w": np.ones((2, 1), np.float32)})
    step = jdp.pmap.train_step(lambda p, b: jnp.mean(b["x"] @ p["w"]))
    assert not jdp.pmap.is_stacked(state.params)   # N rows each, on jdp.mesh(): global
    one_line_error(ValueError, ["state leaf", "jdp.pmap.replicate(state)"], step, state,
                   jdp.pmap.shard({"x": np.ones((N, 2), np.float32)}))


def test_unreplicate_of_a_host_array_with_n_rows_is_refused_not_cut():
    one_line_error(ValueError, ["['w']", f"({N}, 3)", "on the host", "not replicated"],
                   jdp.pmap.unreplicate, {"w": np.zeros((N, 3))})
