"""HSDP (`shard_params=k`): parameters split within groups of k consecutive devices and
replicated across the groups; per-layer gathers inside a group, one reduction of the gradient
shards across the groups; training exactly as single-device optax."""
import re

import jax
import numpy as np
import optax
import pytest
from conftest import free_port, job_env, one_line_error, start_launcher, write_script
from test_fsdp_layers import assert_tree_close, batches, mse_loss, scanned, single_device, stacked

import jdp
from benchmarks.harness import hlo

N, K, L, D = 8, 4, 4, 64
TX = optax.sgd(0.05, momentum=0.9)


def hsdp_state(k=K):
    return jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=stacked(L, D), tx=TX),
                         shard_params=k)


def large_collectives(text: str, min_bytes: int = 1024) -> list[tuple[str, list, int]]:
    """(kind, device groups, runs per step) of every all-gather, reduce-scatter and all-reduce
    whose result is over `min_bytes` (the metrics' scalars and the stop flag are left out)."""
    return [(kind, groups, runs) for kind, size, groups, runs in hlo.grouped(text)
            if size > min_bytes]


def device_groups(n: int, k: int) -> tuple[list, list]:
    """The replica groups within the groups of k consecutive devices of n, and across them."""
    return ([tuple(range(i, i + k)) for i in range(0, n, k)],
            [tuple(range(j, n, k)) for j in range(k)])


def assert_hsdp_collectives(text: str, layers: int = L, shard_bytes: int | None = None,
                            n: int = N, k: int = K):
    """The compiled step's large collectives: gathers and reductions within the groups of k,
    run layer by layer; across the groups only all-reduces, each once a step (the gradient
    shards; `shard_bytes` in all when given): nothing per layer crosses a group."""
    within, across = device_groups(n, k)
    found = large_collectives(text)
    assert any(kind == "all-gather" and runs >= layers for kind, _, runs in found), found
    crossing = [(kind, runs) for kind, groups, runs in found if groups != within]
    assert crossing and all(k == "all-reduce" for k, _ in crossing), found
    assert all(runs == 1 for _, runs in crossing), found      # once a step, not per layer
    assert all(groups in (within, across) for _, groups, _ in found), found
    if shard_bytes is not None:
        got = sum(size * runs for kind, size, groups, runs in hlo.grouped(text)
                  if groups == across and size > 1024)
        assert got == shard_bytes, (got, shard_bytes)


def test_gathers_stay_in_a_group_and_only_the_shards_reduction_crosses_groups():
    """One device's gradient shard (1/4 of the model) crosses the groups, once a step."""
    state, b = hsdp_state(), jdp.shard(batches(N * 4, D)[0])
    text = jdp.train_step(mse_loss(scanned), shard_params=K).lower(state, b).compile().as_text()
    model_bytes = 4 * sum(np.size(x) for x in jax.tree.leaves(stacked(L, D)))
    assert_hsdp_collectives(text, shard_bytes=model_bytes // K)


def test_a_device_holds_a_quarter_of_the_model_and_the_groups_hold_the_same_quarters():
    """At rest every parameter and momentum leaf is split 4 ways within a group; device d and
    device d + 4 (the same place in the other group) hold the same slice."""
    state = hsdp_state()
    leaves = jax.tree.leaves((state.params, state.opt_state))
    assert len(leaves) == 4                      # w, b and their momentum
    for x in leaves:
        shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
        assert all(s.data.size * K == x.size for s in shards), (x.shape, shards[0].data.shape)
        assert [str(s.index) for s in shards[:K]] == [str(s.index) for s in shards[K:]]
        assert len({str(s.index) for s in shards}) == K
    per_device = sum(x.addressable_shards[0].data.size for x in jax.tree.leaves(state.params))
    assert per_device * K == sum(np.size(x) for x in jax.tree.leaves(stacked(L, D)))


def test_accumulation_and_comm_dtype_still_cross_once_a_step_in_bf16():
    """With 2 micro-batches the cross-group all-reduce still runs once, after them, and with
    comm_dtype=bf16 the groups' gradients are summed in bf16, while training stays within
    1e-2."""
    import jax.numpy as jnp
    state, data = hsdp_state(), batches(N * 4, D)
    step = jdp.train_step(mse_loss(scanned), shard_params=K, accum_steps=2,
                          comm_dtype=jnp.bfloat16)
    lowered = step.lower(state, jdp.shard(data[0]))
    assert_hsdp_collectives(lowered.compile().as_text())
    # the sum over the groups' copies, as jdp writes it (XLA:CPU then widens the all-reduce)
    sums = re.findall(r"stablehlo.reduce\(.*across dimensions = \[0\] : \(tensor<2x(\S+)x(\w+)>",
                      lowered.as_text())
    assert sorted(sums) == [("4x64", "bf16"), ("4x64x64", "bf16")], sums
    for b in data:
        state, _ = step(state, jdp.shard(b))
    want = single_device(mse_loss(scanned), stacked(L, D), TX, data)
    for g, w in zip(jax.tree.leaves(jdp.unshard(state).params), jax.tree.leaves(want),
                    strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-2, atol=1e-2)


def test_a_loss_that_communicates_over_the_axis_still_reduces_over_every_device():
    """A loss with its own collective over jdp.AXIS (here the batch mean of the targets) runs
    in one map over all 8 devices: exact, and the collective spans both groups."""
    import jax.numpy as jnp
    from jax import lax

    def loss(params, b):
        centre = lax.pmean(jnp.mean(b["y"], axis=0), jdp.AXIS)     # over all 8 devices
        return jnp.mean((scanned(params, b["x"]) - (b["y"] - centre)) ** 2)

    def single(params, b):
        return jnp.mean((scanned(params, b["x"]) - (b["y"] - jnp.mean(b["y"], axis=0))) ** 2)

    state, data = hsdp_state(), batches(N * 4, D)
    step = jdp.train_step(loss, shard_params=K)
    for b in data:
        state, _ = step(state, jdp.shard(b))
    assert_tree_close(jdp.unshard(state).params, single_device(single, stacked(L, D), TX, data))
    one_line_error(ValueError, ["comm_dtype", "shard_params=4", "collectives over jdp.AXIS"],
                   jdp.train_step(loss, shard_params=K, comm_dtype=jnp.bfloat16), state,
                   jdp.shard(data[0]))


@pytest.mark.parametrize("where", ["remat", "backward"])
def test_a_collective_nested_in_the_loss_or_only_in_its_backward_pass_is_found(where):
    """HSDP reads from the loss's program whether it communicates over jdp.AXIS: a pmean
    inside a rematerialised function, or one in a custom VJP's backward pass only (the
    forward pass names no axis), puts the step in one map over all 8 devices, exactly as
    single-device optax trains."""
    import jax.numpy as jnp
    from jax import lax

    @jax.custom_vjp
    def touch(x):   # the identity, whose backward pass names jdp.AXIS (and adds nothing)
        return x

    touch.defvjp(lambda x: (x, None),
                 lambda _, g: (g + lax.psum(g, jdp.AXIS) - lax.psum(g, jdp.AXIS),))

    def centred(y):   # over all 8 devices' examples
        return y - lax.pmean(jnp.mean(y, axis=0), jdp.AXIS)

    def loss(params, b):
        y = jax.checkpoint(centred)(b["y"]) if where == "remat" else b["y"]
        out = scanned(params, b["x"])
        return jnp.mean(((touch(out) if where == "backward" else out) - y) ** 2)

    def single(params, b):
        y = b["y"] - jnp.mean(b["y"], axis=0) if where == "remat" else b["y"]
        return jnp.mean((scanned(params, b["x"]) - y) ** 2)

    state, data = hsdp_state(), batches(N * 4, D)
    step = jdp.train_step(loss, shard_params=K)
    for b in data:
        state, _ = step(state, jdp.shard(b))
    assert_tree_close(jdp.unshard(state).params, single_device(single, stacked(L, D), TX, data))


def test_the_step_and_the_state_must_agree_on_the_groups():
    batch = jdp.shard(batches(N, D)[0])
    one_line_error(ValueError, ["shard_params=2", "groups of 4 devices", "the same shard_params"],
                   jdp.train_step(mse_loss(scanned), shard_params=2), hsdp_state(), batch)
    one_line_error(ValueError, ["shard_params=3", "divides the device count 8"],
                   jdp.broadcast, jdp.TrainState.create(apply_fn=None, params=stacked(L, D),
                                                        tx=TX), shard_params=3)
    one_line_error(ValueError, ["shard_params='rack'", "\"node\""], jdp.train_step,
                   mse_loss(scanned), shard_params="rack")


def test_a_checkpoint_saved_under_hsdp_restores_under_fsdp_replicated_and_back(tmp_path):
    """Stacked width 20 (4 divides it, 8 does not: FSDP pads it to 24, HSDP does not)."""
    params0, data = stacked(L, 20), batches(N * 2, 20)
    step = jdp.train_step(mse_loss(scanned), shard_params=K)
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params0, tx=TX),
                          shard_params=K)
    for b in data:
        state, _ = step(state, jdp.shard(b))
    want = jax.device_get(jdp.unshard(state))
    template = jdp.TrainState.create(apply_fn=None, params=params0, tx=TX)
    for i, placing in enumerate((True, False, K)):
        ckpt = jdp.checkpoint.Checkpointer(tmp_path / str(i))
        ckpt.save(i + 1, state)
        ckpt.close()
        ckpt = jdp.checkpoint.Checkpointer(tmp_path / str(i))
        state = ckpt.restore(jdp.broadcast(template, shard_params=placing))
        ckpt.close()
        got = jax.device_get(jdp.unshard(state))
        for g, w in zip(jax.tree.leaves((got.params, got.opt_state)),
                        jax.tree.leaves((want.params, want.opt_state)), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    w = state.params["w"]   # split on a layer's rows within groups of K, as placed
    assert w.shape == (L, 20, 20) and w.sharding.mesh.shape["jdp_shard"] == K
    assert w.addressable_shards[0].data.shape == (L, 20 // K, 20)


NODES = """
import os, sys, json, jax, jax.numpy as jnp, numpy as np, optax, jdp
from jax import lax
jdp.initialize()
out = sys.argv[1]
exec(open(sys.argv[2]).read())               # the shared model and data: stacked, scanned, ...
shard = os.environ.get("SHARD", "node")      # "node", or a group size
shard = int(shard) if shard.isdigit() else shard
loss = lambda p, b: jnp.mean((scanned(p, b["x"]) - b["y"]) ** 2)
tx = optax.sgd(0.05, momentum=0.9)
state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=stacked(4, 64), tx=tx),
                      shard_params=shard)
def group(x):   # the devices one copy is split over (None: all of them, no groups)
    return dict(x.sharding.mesh.shape).get("jdp_shard")
node = group(jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=stacked(4, 64), tx=tx),
                           shard_params="node").params["w"])   # None: the node is every device
step = jdp.train_step(loss, shard_params=shard)
per = 32 // jax.process_count()
mine = slice(jax.process_index() * per, (jax.process_index() + 1) * per)
data = batches(32, 64)
text = step.lower(state, jdp.shard({k: v[mine] for k, v in data[0].items()})).compile().as_text()
for b in data:
    state, _ = step(state, jdp.shard({k: v[mine] for k, v in b.items()}))
full = jdp.unshard(state)
np.savez(f"{out}/rank{jax.process_index()}.npz", **{k: np.asarray(v) for k, v in
                                                    full.params.items()})
if jax.process_index() == 0:
    open(f"{out}/step.hlo", "w").write(text)
    open(f"{out}/group.json", "w").write(json.dumps(group(state.params["w"])))
    open(f"{out}/node.json", "w").write(json.dumps(node))
"""


@pytest.mark.parametrize("processes, devices", [(1, 4), pytest.param(2, 2, marks=pytest.mark.long)])
def test_shard_params_node_on_two_nodes_of_four_devices(tmp_path, tag, processes, devices):
    """Two launchers on this machine play two nodes of 4 devices (1 process x 4, or 2 x 2):
    "node" splits within each node's devices; only the gradient shards' reduction crosses."""
    import test_fsdp_layers
    script = write_script(tmp_path, "nodes.py", NODES)
    common = write_script(tmp_path, "common.py", test_fsdp_layers.COMMON)
    port = free_port()
    nodes = [start_launcher(["--nnodes", 2, "--node_rank", node, "--nproc_per_node", processes,
                             "--devices_per_process", devices, "--master_port", port, script,
                             tmp_path, common], job_env(tag)) for node in (1, 0)]
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    data = batches(32, 64)
    want = single_device(mse_loss(scanned), stacked(4, 64), TX, data)
    for rank in range(2 * processes):
        assert_tree_close(dict(np.load(tmp_path / f"rank{rank}.npz")), want)
    assert (tmp_path / "group.json").read_text() == (tmp_path / "node.json").read_text() == "4"
    assert_hsdp_collectives((tmp_path / "step.hlo").read_text())


def assert_node_job(out, processes: int, devices: int, k: int):
    """What `NODES` left in `out`, run by an engine on this one machine with SHARD=k: every
    rank's model equals single-device optax's, split in groups of k; "node" is all devices."""
    want = single_device(mse_loss(scanned), stacked(4, 64), TX, batches(32, 64))
    for rank in range(processes):
        assert_tree_close(dict(np.load(out / f"rank{rank}.npz")), want)
    assert (out / "group.json").read_text() == str(k)
    assert (out / "node.json").read_text() == "null"
    assert_hsdp_collectives((out / "step.hlo").read_text(), n=processes * devices, k=k)


def test_accumulation_clipped_adam_and_eval_step_under_hsdp():
    import jax.numpy as jnp
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    data, loss = batches(N * 4, D), mse_loss(scanned)
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=stacked(L, D), tx=tx),
                          shard_params=K)
    step = jdp.train_step(loss, shard_params=K, accum_steps=2)
    for b in data:
        state, _ = step(state, jdp.shard(b))
    want = single_device(loss, stacked(L, D), tx, data)
    assert_tree_close(jdp.unshard(state).params, want)
    totals = jdp.eval_step(lambda s, b: {"sq": jnp.mean((scanned(s.params, b["x"]) - b["y"]) ** 2,
                                                        axis=1)})(state, jdp.shard(data[0]))
    np.testing.assert_allclose(float(totals["sq"]) / float(totals["count"]),
                               float(loss(want, data[0])), rtol=1e-5)


@pytest.mark.parametrize("tx", [
    optax.sgd(optax.linear_schedule(0.05, 0.005, 3), momentum=0.9),
    optax.MultiSteps(optax.sgd(0.05, momentum=0.9), every_k_schedule=2)],
    ids=["schedule", "multisteps"])
def test_a_schedule_and_multisteps_under_hsdp_equal_single_device_optax(tx):
    """Optimizer state that counts steps (a schedule, MultiSteps' accumulated gradient) is
    stored and updated in groups as the parameters are, and trains exactly. SGD-momentum, not
    Adam: Adam divides a near-zero gradient by its own size, which turns the two reduction
    orders' float32 rounding into CPU-dependent steps (seen on another CPU with Adam: one
    element of 16384 off by 1.4e-5)."""
    data, loss = batches(N * 4, D, steps=4), mse_loss(scanned)
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=stacked(L, D), tx=tx),
                          shard_params=K)
    step = jdp.train_step(loss, shard_params=K)
    for b in data:
        state, _ = step(state, jdp.shard(b))
    assert_tree_close(jdp.unshard(state).params, single_device(loss, stacked(L, D), tx, data))
