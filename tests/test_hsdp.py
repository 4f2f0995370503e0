"""HSDP (`shard_params=k`): parameters split within groups of k consecutive devices and
replicated across the groups; per-layer gathers inside a group, one reduction of the gradient
shards across the groups; training exactly as single-device optax."""
import math
import re

import jax
import numpy as np
import optax
from conftest import one_line_error
from test_fsdp_layers import assert_tree_close, batches, mse_loss, scanned, single_device, stacked

import jdp

N, K, L, D = 8, 4, 4, 64
TX = optax.sgd(0.05, momentum=0.9)


def hsdp_state(k=K):
    return jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=stacked(L, D), tx=TX),
                         shard_params=k)


def replica_groups(line: str) -> list[tuple[int, ...]]:
    """The device groups of one collective in compiled HLO text (explicit or iota form)."""
    explicit = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
    if explicit:
        return sorted(tuple(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}",
                                                                        explicit[1]))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]T\(([\d,]+)"
                  r"\)\))? \{([^}]*)\}", line)
    dims = re.findall(r"'(\w+)'=(\d+)", m[1])
    sizes = [int(s) for _, s in dims]
    ids = np.arange(math.prod(sizes))
    if m[2]:
        ids = ids.reshape([int(s) for s in m[2].split(",")]).transpose(
            [int(s) for s in m[3].split(",")])
    ids = ids.reshape(sizes)
    named = re.findall(r"'(\w+)'", m[4])
    axes = [i for i, (name, _) in enumerate(dims) if name in named]
    rest = [i for i in range(len(dims)) if i not in axes]
    groups = ids.transpose(rest + axes).reshape(-1, math.prod(sizes[a] for a in axes))
    return sorted(tuple(g) for g in groups.tolist())


def large_collectives(text: str, min_bytes: int = 1024) -> list[tuple[str, list]]:
    """(kind, groups) of every all-gather, reduce-scatter and all-reduce moving more than
    `min_bytes` (the metrics' scalars and the stop flag are left out)."""
    out = []
    for line in text.splitlines():
        m = re.search(r"= (\w+)\[([\d,]*)\]\S* (all-gather|reduce-scatter|all-reduce)"
                      r"(?:-start)?\(", line)
        if m and math.prod(int(d) for d in m[2].split(",") if d) * 4 > min_bytes:
            out.append((m[3], replica_groups(line)))
    return out


def test_groups_of_4_on_8_devices_train_exactly_and_hold_a_quarter_of_the_model():
    state, data = hsdp_state(), batches(N * 4, D)
    step = jdp.train_step(mse_loss(scanned), shard_params=K)
    for b in data:
        state, _ = step(state, jdp.shard(b))
    assert_tree_close(jdp.unshard(state).params,
                      single_device(mse_loss(scanned), stacked(L, D), TX, data))
    assert state.params["w"].shape == (L, D, D)
    for x in jax.tree.leaves((state.params, state.opt_state)):
        assert x.addressable_shards[0].data.size * K == x.size, x.shape   # 1/4 per device


def test_gathers_stay_in_a_group_and_only_the_shards_reduction_crosses_groups():
    state, b = hsdp_state(), jdp.shard(batches(N * 4, D)[0])
    text = jdp.train_step(mse_loss(scanned), shard_params=K).lower(state, b).compile().as_text()
    within, across = [(0, 1, 2, 3), (4, 5, 6, 7)], [(0, 4), (1, 5), (2, 6), (3, 7)]
    found = large_collectives(text)
    assert any(kind == "all-gather" for kind, _ in found), found
    for kind, groups in found:
        assert groups == (across if kind == "all-reduce" and groups == across else within), (
            kind, groups)
    assert ("all-reduce", across) in found            # the gradient shards, across the groups


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
    assert state.params["w"].group == K and state.params["w"].value.shape == (L, 20, 20)
