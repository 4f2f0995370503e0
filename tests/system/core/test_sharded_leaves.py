"""FSDP's `Sharded` parameters act as arrays or say what to do: `np.asarray` gives the model's
value, every other array use names `jdp.unshard`; `jdp.unshard` and `Checkpointer.save` take any
subtree; non-float optimizer-state leaves (PRNG keys) are never split or padded."""
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    child_env,
    job_env,
    one_line_error,
    run_python,
    start_launcher,
    write_script,
)

import jdp
from jdp.checkpoint import Checkpointer

N = 8
SHARDINGS = [True, 4]   # FSDP over all 8 devices, HSDP in groups of 4
MODEL = nn.Dense(12)    # kernel (3, 12): 8 devices divide neither axis, so it is padded


def model_params():
    """The model's parameters, with values that differ everywhere (as host numpy arrays)."""
    params = MODEL.init(jax.random.key(0), np.zeros((1, 3), np.float32))
    return jax.tree.map(lambda x: (np.asarray(x) + np.arange(x.size).reshape(x.shape) * 0.01
                                   ).astype(np.float32), params)


def sharded_state(shard_params=True, tx=None):
    return jdp.broadcast(jdp.TrainState.create(apply_fn=MODEL.apply, params=model_params(),
                                               tx=tx or optax.adam(0.1)),
                         shard_params=shard_params)


def kernel(state):
    return state.params["params"]["kernel"]


@pytest.mark.parametrize("shard", SHARDINGS)
def test_np_asarray_of_a_sharded_leaf_is_the_models_value(shard):
    want = model_params()["params"]
    state = sharded_state(shard)
    got = np.asarray(kernel(state))
    assert got.shape == (3, 12) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want["kernel"])
    np.testing.assert_array_equal(np.asarray(state.params["params"]["bias"], np.float64),
                                  want["bias"].astype(np.float64))
    np.testing.assert_allclose(kernel(state), want["kernel"])   # numpy's testing converts too
    assert len(kernel(state)) == 3 and kernel(state).shape == (3, 12)


X = np.ones((2, 3), np.float32)
ARRAY_USES = {
    "jnp.asarray": lambda p: jnp.asarray(p),
    "jnp.sum": lambda p: jnp.sum(p),
    "leaf + 1": lambda p: p + 1,
    "1 - leaf": lambda p: 1 - p,
    "numpy x @ leaf": lambda p: X @ p,
    "jax x @ leaf": lambda p: jnp.asarray(X) @ p,
    "-leaf": lambda p: -p,
    "leaf < 0": lambda p: p < 0,
    "leaf == leaf": lambda p: p == p,
    "leaf[0]": lambda p: p[0],
    "list(leaf)": lambda p: list(p),
    "jit of x @ leaf": lambda p: jax.jit(lambda q, x: x @ q)(p, X),
}


@pytest.mark.parametrize("use", list(ARRAY_USES))
def test_every_other_array_use_of_a_sharded_leaf_names_jdp_unshard(use):
    one_line_error(TypeError, ["jdp.unshard(state.params)", "(3, 12)", "shard_params=True"],
                   ARRAY_USES[use], kernel(sharded_state()))


def test_an_array_method_names_jdp_unshard_and_hsdp_names_its_group():
    one_line_error(AttributeError, ["jdp.unshard", ".sum", "shard_params=4"],
                   lambda p: p.sum(), kernel(sharded_state(4)))
    assert not hasattr(kernel(sharded_state()), "sharding")   # probes still miss plainly


@pytest.mark.parametrize("jit", [False, True], ids=["apply", "jit_apply"])
def test_model_apply_on_sharded_params_names_jdp_unshard(jit):
    state = sharded_state()
    apply = jax.jit(MODEL.apply) if jit else MODEL.apply
    one_line_error(TypeError, ["jdp.unshard(state.params)", "model.apply"], apply,
                   state.params, X)


def test_an_nnx_model_merged_from_sharded_params_names_jdp_unshard():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(3, 12, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params,
                                                tx=optax.adam(0.1)), shard_params=True)
    one_line_error(TypeError, ["jdp.unshard(state.params)", "(3, 12)"],
                   lambda: nnx.merge(graphdef, state.params, rest)(X))
    merged = nnx.merge(graphdef, jdp.unshard(state.params), rest)
    np.testing.assert_allclose(np.asarray(merged(X)), np.asarray(model(X)), rtol=1e-6)


@pytest.mark.parametrize("shard", SHARDINGS)
def test_unshard_of_the_params_subtree_gives_replicated_model_arrays(shard):
    state = sharded_state(shard)
    for tree in (state.params, {"kernel": kernel(state)}):
        full = jdp.unshard(tree)
        for leaf in jax.tree.leaves(full):
            assert isinstance(leaf, jax.Array) and leaf.sharding.is_fully_replicated
    full = jdp.unshard(state.params)
    np.testing.assert_allclose(np.asarray(MODEL.apply(full, X)),
                               np.asarray(MODEL.apply(model_params(), X)), rtol=1e-6)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(full), model_params())


def test_unshard_of_a_stored_optimizer_state_alone_says_to_pass_the_state():
    state = sharded_state()
    for tree in (state.opt_state, {"params": state.params, "opt_state": state.opt_state}):
        one_line_error(ValueError, ["jdp.unshard", "mu", "jdp.unshard(state).opt_state"],
                       jdp.unshard, tree)
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


@pytest.mark.parametrize("key", ["typed", "int"])
@pytest.mark.parametrize("layout", [{"shard_optimizer": True}, {"shard_params": True},
                                    {"shard_params": 4}], ids=["zero", "fsdp", "hsdp4"])
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
import json, sys, jax, numpy as np, optax, jdp
directory, form = sys.argv[1], sys.argv[2]
zeros = {"params": {"bias": np.zeros(12, np.float32), "kernel": np.zeros((3, 12), np.float32)}}
template = (jdp.broadcast(zeros) if form == "plain" else jdp.broadcast(jdp.TrainState.create(
    apply_fn=None, params=zeros, tx=optax.adam(0.1)), shard_params=True).params)
params = jdp.unshard(jdp.checkpoint.Checkpointer(directory).restore(template))
print(json.dumps({k: np.asarray(v).tolist() for k, v in params["params"].items()}))
"""


@pytest.mark.parametrize("devices, form", [(2, "plain"), (6, "fsdp")])
def test_a_saved_params_subtree_restores_on_another_device_count(tmp_path, devices, form):
    Checkpointer(tmp_path / "ckpt").save(1, sharded_state(True).params)
    script = write_script(tmp_path, "restore.py", RESTORE)
    res = run_python([script, tmp_path / "ckpt", form], env=child_env(devices=devices),
                     timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for name, want in model_params()["params"].items():
        np.testing.assert_array_equal(np.asarray(got[name], np.float32), want)


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
except TypeError as e:
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


def test_on_two_processes_a_leaf_split_across_them_and_an_unsynced_model_state_are_named(
        tmp_path, tag):
    script = write_script(tmp_path, "two.py", TWO_PROCESSES)
    launcher = start_launcher(["--nproc_per_node", "2", "--devices_per_process", "2", script,
                               tmp_path], env=job_env(tag))
    _, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, err
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "jdp.unshard(state.params) on every process" in out["asarray"], out
        assert "\n" not in out["asarray"] + out["sync"]
        np.testing.assert_array_equal(out["unsharded"], np.arange(36).reshape(3, 12))
        assert "model_state_sync=None" in out["sync"] and "model_state['m']" in out["sync"]
