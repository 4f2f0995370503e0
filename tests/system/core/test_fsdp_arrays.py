"""FSDP's parameters are `jax.Array`s of the model's shapes: every JAX, flax, optax and orbax
tool gives the model's numbers on them, as on the replicated parameters; a leaf no device count
divides is kept whole and said; `jdp.unshard` and `Checkpointer.save` take any subtree;
non-float optimizer-state leaves (PRNG keys) are never split."""
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import (
    child_env,
    job_env,
    run_python,
    start_launcher,
    write_script,
)
from flax import serialization, traverse_util

import jdp
from jdp.checkpoint import Checkpointer

N = 8
SHARDINGS = [True, 4]   # FSDP over all 8 devices, HSDP in groups of 4
# kernel (3, 16) and bias (16,): split over 8 devices; kernel (16, 12): split on its 16 rows;
# bias (12,): no axis 8 divides, kept whole (4 divides it: split under HSDP in groups of 4)
MODEL = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(12)])
SPLIT_AXES = {True: {("layers_0", "kernel"): 1, ("layers_0", "bias"): 0,
                     ("layers_2", "kernel"): 0, ("layers_2", "bias"): None},
              4: {("layers_0", "kernel"): 1, ("layers_0", "bias"): 0,
                  ("layers_2", "kernel"): 0, ("layers_2", "bias"): 0}}


def model_params():
    """The model's parameters, with values that differ everywhere (as host numpy arrays)."""
    params = MODEL.init(jax.random.key(0), np.zeros((1, 3), np.float32))
    return jax.tree.map(lambda x: (np.asarray(x) + np.arange(x.size).reshape(x.shape) * 0.01
                                   ).astype(np.float32), params)


def sharded_state(shard_params=True, tx=None):
    return jdp.broadcast(jdp.TrainState.create(apply_fn=MODEL.apply, params=model_params(),
                                               tx=tx or optax.adam(0.1)),
                         shard_params=shard_params)


def by_layer(params):
    return {(layer, name): x for layer, leaves in params["params"].items()
            for name, x in leaves.items()}


@pytest.mark.parametrize("shard", SHARDINGS)
def test_fsdp_parameters_are_arrays_of_the_models_shapes_split_where_the_devices_divide(shard):
    want = by_layer(model_params())
    state = sharded_state(shard)
    for key, x in by_layer(state.params).items():
        assert isinstance(x, jax.Array) and x.shape == want[key].shape and x.dtype == np.float32
        axis = SPLIT_AXES[shard][key]
        if axis is None:
            assert x.sharding.is_fully_replicated, key
        else:
            k = 8 if shard is True else shard
            assert {s.data.shape[axis] for s in x.addressable_shards} == {x.shape[axis] // k}
        np.testing.assert_array_equal(np.asarray(x), want[key])
    for leaf, p in zip(jax.tree.leaves(state.opt_state[0].mu), jax.tree.leaves(state.params),
                       strict=True):   # Adam's moments split as their parameters
        assert leaf.sharding == p.sharding and leaf.shape == p.shape


X = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)


def test_jax_flax_optax_orbax_and_print_give_what_the_replicated_parameters_give(tmp_path):
    """The issue's list, applied to FSDP's parameters and to the replicated ones."""
    host = model_params()
    fsdp, plain = sharded_state().params, jdp.broadcast(host)
    same = lambda a, b: jax.tree.map(np.testing.assert_array_equal, jax.device_get(a),  # noqa: E731
                                     jax.device_get(b))
    close = lambda a, b: jax.tree.map(  # noqa: E731  (a split sum adds in another order)
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), jax.device_get(a),
        jax.device_get(b))
    close(jax.tree.map(jnp.mean, fsdp), jax.tree.map(jnp.mean, plain))
    same(jax.tree.map(lambda p: p.size, fsdp), jax.tree.map(np.size, host))
    assert sum(x.size for x in jax.tree.leaves(fsdp)) == 3 * 16 + 16 + 16 * 12 + 12
    bias = fsdp["params"]["layers_0"]["bias"]
    assert float(bias[3]) == float(host["params"]["layers_0"]["bias"][3])
    same(jax.tree.map(np.asarray, fsdp), host)
    close(MODEL.apply(fsdp, X), MODEL.apply(plain, X))
    close(jax.jit(MODEL.apply)(fsdp, X), jax.jit(MODEL.apply)(plain, X))
    assert serialization.to_bytes(fsdp) == serialization.to_bytes(plain)
    same(serialization.from_bytes(host, serialization.to_bytes(fsdp)), host)
    zeros = jax.tree.map(jnp.zeros_like, plain)
    same(optax.incremental_update(fsdp, zeros, 0.1), optax.incremental_update(plain, zeros, 0.1))
    assert [repr(x) for x in jax.tree.leaves(fsdp)] == [repr(x) for x in jax.tree.leaves(plain)]
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "orbax", fsdp)
    checkpointer.wait_until_finished()
    back = checkpointer.restore(tmp_path / "orbax", jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), fsdp))
    same(back, host)
    for b, x in zip(jax.tree.leaves(back), jax.tree.leaves(fsdp), strict=True):
        assert b.sharding == x.sharding


@pytest.mark.parametrize("shard", SHARDINGS)
def test_unshard_of_the_params_subtree_gives_replicated_model_arrays(shard):
    state = sharded_state(shard)
    for tree in (state.params, {"kernel": state.params["params"]["layers_0"]["kernel"]}):
        full = jdp.unshard(tree)
        for leaf in jax.tree.leaves(full):
            assert isinstance(leaf, jax.Array) and leaf.sharding.is_fully_replicated
    full = jdp.unshard(state.params)
    np.testing.assert_allclose(np.asarray(MODEL.apply(full, X)),
                               np.asarray(MODEL.apply(model_params(), X)), rtol=1e-6)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(full), model_params())


def test_unshard_of_any_subtree_gathers_its_split_leaves_and_leaves_the_rest():
    state = sharded_state()
    whole = jdp.unshard(state.opt_state)
    for got, split in zip(jax.tree.leaves(whole), jax.tree.leaves(state.opt_state), strict=True):
        assert got.sharding.is_fully_replicated and got.shape == split.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(split))
    plain = jdp.broadcast(model_params())
    assert jdp.unshard(plain) is plain   # nothing stored split: as it is


def test_a_saved_params_subtree_restores_into_plain_and_hsdp_parameters(tmp_path):
    want = model_params()
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, sharded_state(True).params)
    zeros = jax.tree.map(np.zeros_like, want)
    plain = ckpt.restore(jdp.broadcast(zeros))
    for got, w in zip(jax.tree.leaves(plain), jax.tree.leaves(want), strict=True):
        assert got.sharding.is_fully_replicated and got.shape == w.shape
        np.testing.assert_array_equal(np.asarray(got), w)
    hsdp = ckpt.restore(jdp.broadcast(jdp.TrainState.create(
        apply_fn=None, params=zeros, tx=optax.adam(0.1)), shard_params=4).params)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(jdp.unshard(hsdp)), want)
    host = ckpt.restore(zeros)   # numpy leaves: one host copy
    jax.tree.map(np.testing.assert_array_equal, host, want)


def noisy_mse(params, batch):
    return jnp.mean((MODEL.apply(params, batch["x"]) - batch["y"]) ** 2)


def noisy_tx(key):
    return optax.chain(optax.add_noise(0.1, 0.55, key=key), optax.adam(1e-2))


LAYOUTS = {"zero": {"shard_optimizer": True}, "fsdp": {"shard_params": True},
           "hsdp4": {"shard_params": 4}}


@pytest.mark.parametrize("layout, key", [   # make test keeps FSDP's typed key, the common case
    pytest.param(LAYOUTS[name], key, id=f"{name}-{key}",
                 marks=() if (name, key) == ("fsdp", "typed") else pytest.mark.long)
    for key in ("typed", "int") for name in LAYOUTS])
def test_add_noise_keeps_its_key_whole_and_trains_as_single_device_optax(layout, key):
    """`add_noise`'s state holds a PRNG key: split or padded it would be another key."""
    tx = noisy_tx(jax.random.key(7) if key == "typed" else 7)
    rng = np.random.default_rng(0)
    data = [{"x": rng.normal(size=(N * 2, 3)).astype(np.float32),
             "y": rng.normal(size=(N * 2, 12)).astype(np.float32)} for _ in range(3)]
    params, opt_state = model_params(), tx.init(model_params())
    for b in data:   # the reference: plain optax on one device, on the global batch
        updates, opt_state = tx.update(jax.grad(noisy_mse)(params, b), opt_state, params)
        params = optax.apply_updates(params, updates)

    def run(**options):
        state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=model_params(),
                                                    tx=tx), **options)
        step = jdp.train_step(noisy_mse, **options)
        for b in data:
            state, _ = step(state, jdp.shard(b))
        return jax.device_get(jdp.unshard(state).params)

    replicated, sharded = run(), run(**layout)
    for got in (replicated, sharded):
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6),
                     got, jax.device_get(params))
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7),
                 sharded, replicated)


RESTORE = """
import json, sys, flax.linen as nn, jax, numpy as np, optax, jdp
directory, form = sys.argv[1], sys.argv[2]
model = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(12)])
zeros = jax.tree.map(np.zeros_like, model.init(jax.random.key(1), np.zeros((1, 3), np.float32)))
template = (jdp.broadcast(zeros) if form == "plain" else jdp.broadcast(jdp.TrainState.create(
    apply_fn=None, params=zeros, tx=optax.adam(0.1)), shard_params=True).params)
params = jdp.unshard(jdp.checkpoint.Checkpointer(directory).restore(template))
from flax import traverse_util
flat = traverse_util.flatten_dict(params, sep="/")
print(json.dumps({k: np.asarray(v).tolist() for k, v in flat.items()}))
"""


@pytest.mark.parametrize("devices, form", [(2, "plain"), (6, "fsdp")])
def test_a_saved_params_subtree_restores_on_another_device_count(tmp_path, devices, form):
    Checkpointer(tmp_path / "ckpt").save(1, sharded_state(True).params)
    script = write_script(tmp_path, "restore.py", RESTORE)
    res = run_python([script, tmp_path / "ckpt", form], env=child_env(devices=devices),
                     timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    want = traverse_util.flatten_dict(model_params(), sep="/")
    assert set(got) == set(want)
    for name, w in want.items():
        np.testing.assert_array_equal(np.asarray(got[name], np.float32), w)


TWO_PROCESSES = """
import json, sys, jax, jax.numpy as jnp, numpy as np, optax, jdp
from jax import lax
jdp.initialize()
params = {"w": np.arange(36, dtype=np.float32).reshape(3, 12)}
state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1),
                                            model_state={"m": np.zeros((), np.float32)}),
                      shard_params=True)
out = {}
try:
    np.asarray(state.params["w"])
except RuntimeError as e:
    out["asarray"] = str(e)
out["unsharded"] = np.asarray(jdp.unshard(state.params)["w"]).tolist()

def loss(p, batch, ms):   # the model state: each device's own batch mean
    return jnp.mean((batch["x"] @ p["w"]) ** 2), {"m": ms["m"] + jnp.mean(batch["x"])}

rows = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
mine = rows[jax.process_index() * 4:(jax.process_index() + 1) * 4]
try:
    jdp.train_step(loss, shard_params=True, model_state_sync=None)(state, jdp.shard({"x": mine}))
except ValueError as e:
    out["sync"] = str(e)
with open(f"{sys.argv[1]}/rank{jax.process_index()}.json", "w") as f:
    json.dump(out, f)
"""


def test_on_two_processes_unshard_gathers_a_leaf_split_across_them_and_unsynced_state_is_named(
        tmp_path, tag):
    script = write_script(tmp_path, "two.py", TWO_PROCESSES)
    launcher = start_launcher(["--nproc_per_node", "2", "--devices_per_process", "2", script,
                               tmp_path], env=job_env(tag))
    _, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, err
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "process_allgather" in out["asarray"], out   # JAX's own: this host lacks some
        assert "\n" not in out["sync"]
        np.testing.assert_array_equal(out["unsharded"], np.arange(36).reshape(3, 12))
        assert "model_state_sync=None" in out["sync"] and "model_state['m']" in out["sync"]


def test_a_large_parameter_no_device_count_divides_is_kept_whole_and_said_once_placed():
    """(500, 530): 8 divides neither axis, so every device keeps the 1 MiB whole; said at
    `jdp.broadcast` with its name and size. The small bias of 12 beside it is not worth a
    word, and a model whose widths 8 divides is silent."""
    params = {"big": np.ones((500, 530), np.float32), "bias": np.zeros(12, np.float32),
              "split": np.ones((512, 512), np.float32)}
    state = jdp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    with pytest.warns(UserWarning) as caught:
        placed = jdp.broadcast(state, shard_params=True)
    text = str(caught[0].message)
    assert len(caught) == 1 and "['big']" in text and "1.0 MiB" in text, text
    assert "8 devices divide" in text and "['bias']" in text, text
    assert placed.params["big"].sharding.is_fully_replicated
    assert not placed.params["split"].sharding.is_fully_replicated
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jdp.broadcast(state.replace(params={"split": params["split"], "bias": params["bias"]}),
                      shard_params=True)
