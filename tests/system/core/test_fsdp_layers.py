"""FSDP that saves memory: a model whose layers are scanned gathers one layer at a time, with no
jdp call in the model; parameters report the model's shapes; bf16 compute computes in bf16.

Peaks are the compiled step's (`memory_analysis()`: arguments + outputs - aliases + temps),
compared with a hand-written per-layer FSDP step compiled in the same test; numbers with
single-device optax on the global batch."""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import child_env, run_python, write_script
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jdp

N, L, D, PER = 8, 48, 128, 16   # devices, layers, width, examples per device

# The stacked MLP and its data, shared with the 6-device child script (which execs it).
COMMON = """
import jax, jax.numpy as jnp, numpy as np, optax
from jax import lax

def stacked(layers, width, seed=0):
    rng = np.random.default_rng(seed)
    return {"w": (rng.standard_normal((layers, width, width)) / width ** 0.5).astype(np.float32),
            "b": (0.1 * rng.standard_normal((layers, width))).astype(np.float32)}

def scanned(params, x):  # one layer per iteration, each under remat: what a deep model does
    def layer(h, wb):
        return jnp.tanh(h @ wb[0] + wb[1]), None
    return lax.scan(jax.checkpoint(layer), x, (params["w"], params["b"]))[0]

def batches(rows, width, steps=3):
    out = []
    for s in range(steps):
        rng = np.random.default_rng(100 + s)
        out.append({k: rng.standard_normal((rows, width)).astype(np.float32) for k in "xy"})
    return out

def single_device(loss, params, tx, data):
    opt_state = tx.init(params)
    for b in data:
        updates, opt_state = tx.update(jax.grad(loss)(params, b), opt_state, params)
        params = optax.apply_updates(params, updates)
    return params
"""
namespace: dict = {}
exec(COMMON, namespace)
stacked, scanned, batches, single_device = (namespace[k] for k in (
    "stacked", "scanned", "batches", "single_device"))
TX = optax.sgd(0.05, momentum=0.9)


def mse_loss(model):
    return lambda params, batch: jnp.mean((model(params, batch["x"]) - batch["y"]) ** 2)


def peak_mib(compiled) -> float:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes) / 2**20


@pytest.fixture(scope="module")
def hand_written_peak() -> float:
    """The reference: a shard_map step whose scan body all-gathers only its layer's rows, under
    remat (the backward pass gathers again), with the same SGD-momentum update on the shards."""
    mesh, rows = jdp.mesh(), NamedSharding(jdp.mesh(), P(None, jdp.AXIS))

    def per_device(params, opt_state, batch):
        def model(p, x):
            def layer(h, wb):
                w, b = (lax.all_gather(t, jdp.AXIS, axis=0, tiled=True) for t in wb)
                return jnp.tanh(h @ w + b), None
            return lax.scan(jax.checkpoint(layer), x, (p["w"], p["b"]))[0]
        grads = jax.grad(lambda p: mse_loss(model)(p, batch) / N)(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = jax.device_put(stacked(L, D), rows)
    opt_state = jax.tree.map(lambda x: jax.device_put(x, rows), TX.init(stacked(L, D)))
    spec, opt_spec = (jax.tree.map(lambda _: P(None, jdp.AXIS), t) for t in (params, opt_state))
    step = jax.shard_map(per_device, mesh=mesh, in_specs=(spec, opt_spec, P(jdp.AXIS)),
                         out_specs=(spec, opt_spec), check_vma=False)
    batch = jdp.shard(batches(N * PER, D)[0])
    return peak_mib(jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state,
                                                              batch).compile())


def fsdp_peak_and_params(loss, params):
    """jdp's FSDP step on `params`: its compiled peak, and the parameters after 3 steps."""
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=TX),
                          shard_params=True)
    step, data = jdp.train_step(loss, shard_params=True), batches(N * PER, D)
    peak = peak_mib(step.lower(state, jdp.shard(data[0])).compile())
    for b in data:
        state, _ = step(state, jdp.shard(b))
    return peak, jdp.unshard(state).params


def assert_tree_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_a_48_layer_scanned_mlp_peaks_like_per_layer_fsdp_and_trains_exactly(hand_written_peak):
    loss = mse_loss(scanned)
    peak, params = fsdp_peak_and_params(loss, stacked(L, D))
    assert peak <= 1.15 * hand_written_peak, (peak, hand_written_peak)
    assert_tree_close(params, single_device(loss, stacked(L, D), TX, batches(N * PER, D)))


def test_a_flax_linen_nn_scan_model_peaks_like_per_layer_fsdp_and_trains_exactly(
        hand_written_peak):
    import flax.linen as nn

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return jnp.tanh(nn.Dense(D)(h)), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            layers = nn.scan(nn.remat(Layer), variable_axes={"params": 0},
                             split_rngs={"params": True}, length=L)
            return layers()(x, None)[0]

    net = Net()
    params0 = net.init(jax.random.key(0), jnp.zeros((1, D)))["params"]
    loss = mse_loss(lambda p, x: net.apply({"params": p}, x))
    peak, params = fsdp_peak_and_params(loss, params0)
    assert peak <= 1.15 * hand_written_peak, (peak, hand_written_peak)
    assert_tree_close(params, single_device(loss, params0, TX, batches(N * PER, D)))


def test_a_flax_nnx_scan_model_peaks_like_per_layer_fsdp_and_trains_exactly(hand_written_peak):
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, h):
            return jnp.tanh(self.dense(h))

    class Net(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=L)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Layer(rngs)
            self.layers = make(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            @nnx.remat
            def run(h, layer):
                return layer(h)
            return run(x, self.layers)

    graphdef, params0 = nnx.split(Net(nnx.Rngs(0)), nnx.Param)
    loss = mse_loss(lambda p, x: nnx.merge(graphdef, p)(x))
    peak, params = fsdp_peak_and_params(loss, params0)
    assert peak <= 1.15 * hand_written_peak, (peak, hand_written_peak)
    assert_tree_close(params, single_device(loss, params0, TX, batches(N * PER, D)))


SIX = COMMON + """
import sys, jdp
params0, tx = stacked(4, 20), optax.sgd(0.05, momentum=0.9)   # 6 devices do not divide 20
loss = lambda p, b: jnp.mean((scanned(p, b["x"]) - b["y"]) ** 2)
state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params0, tx=tx),
                      shard_params=True)
step, data = jdp.train_step(loss, shard_params=True), batches(jax.device_count() * 2, 20)
for b in data:
    state, _ = step(state, jdp.shard(b))
want = single_device(loss, params0, tx, data)
got = jdp.unshard(state).params
print(__import__("json").dumps({
    "shapes": {k: list(v.shape) for k, v in state.params.items()},
    "stored": {k: list(v.addressable_shards[0].data.shape) for k, v in state.params.items()},
    "error": max(float(np.max(np.abs(np.asarray(got[k]) - want[k]))) for k in want)}))
"""


def test_six_devices_keep_whole_and_train_exactly_a_scanned_model_they_do_not_divide(tmp_path):
    script = write_script(tmp_path, "six.py", SIX)
    res = run_python([script], env=child_env(devices=6), timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["shapes"] == {"w": [4, 20, 20], "b": [4, 20]}
    assert out["stored"] == {"w": [4, 20, 20], "b": [4, 20]}     # no axis 6 divides: whole
    assert out["error"] < 1e-5, out


def test_sharded_parameters_report_the_models_shapes_dtypes_and_size():
    params = {**stacked(4, 20), "scale": np.float32(2.0)}
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=TX),
                          shard_params=True)
    for k, want in params.items():
        got = state.params[k]
        assert (got.shape, got.dtype, got.ndim, got.size) == (
            np.shape(want), np.dtype(np.float32), np.ndim(want), np.size(want)), k
    count = sum(x.size for x in jax.tree.leaves(state.params, is_leaf=lambda x: hasattr(
        x, "size")))
    assert count == sum(np.size(x) for x in params.values())


def _dot_types(lowered) -> set:
    """Element types of the operands of every dot_general in the lowered program."""
    found = re.findall(r"stablehlo\.dot_general .*: \(tensor<[\dx]*x(\w+)>, tensor<[\dx]*x(\w+)>\)",
                       lowered.as_text())
    return {t for pair in found for t in pair}


def test_bf16_compute_runs_a_linen_dense_models_dots_in_bf16():
    """Read in the lowered program (XLA:CPU itself computes bf16 in f32 after that): flax's
    `nn.Dense` promotes bf16 parameters with a float32 batch, so the batch is cast too."""
    import flax.linen as nn

    net = nn.Sequential([nn.Dense(64), nn.tanh, nn.Dense(64)])   # flax's default dtype
    params = net.init(jax.random.key(0), jnp.zeros((1, 64)))["params"]
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=TX),
                          shard_params=True)
    batch = jdp.shard(batches(N * 4, 64)[0])           # float32, as the Loader gives it
    loss = mse_loss(lambda p, x: net.apply({"params": p}, x))

    def dots(**kw):
        step = jdp.train_step(loss, shard_params=True, compute_dtype=jnp.bfloat16, **kw)
        return _dot_types(step.lower(state, batch))

    assert dots() == {"bf16"}
    assert dots(cast_batch=False) == {"f32"}              # the opt-out: flax promotes to f32
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
