"""ZeRO's sharded optimizer state (jdp.broadcast(..., shard_optimizer=True)) checkpoints as one
logical copy: it restores sharded, unsharded or stacked, on 8 devices and on 2, and back."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _checkpoint_child import busy_state, host_leaves, make_state
from conftest import REPO, child_env, run_python

import jdp
from jdp.checkpoint import Checkpointer

CHILD = os.path.join(REPO, "tests", "system", "checkpoint", "_checkpoint_child.py")
SAVED = {k: np.asarray(jnp.asarray(v)) for k, v in host_leaves(busy_state(4)).items()}


def logical(state) -> dict:
    """{path: host value}."""
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def assert_saved_values(state):
    got = logical(state)
    assert got.keys() == SAVED.keys()
    for name, want in SAVED.items():
        assert got[name].shape == want.shape and got[name].tobytes() == want.tobytes(), name


def assert_sharded(state, n=8):
    """Optimizer moments in their own shapes, split along the data axis on one axis that n
    divides (whole where none does); the rest replicated."""
    for p, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(p)
        assert x.shape == SAVED[name].shape, name
        assert_split(name, x.shape, x.sharding.spec, n)
        assert x.sharding.mesh == jdp.mesh(), name


def assert_split(name, shape, spec, n):
    moment = name.startswith(".opt_state") and len(shape)
    axes = [a for a, s in enumerate(spec) if s == "batch"]
    if moment and any(d % n == 0 for d in shape):
        assert len(axes) == 1 and shape[axes[0]] % n == 0, (name, spec)
    else:
        assert not axes, (name, spec)


@pytest.mark.parametrize("into", ["sharded", "unsharded", "stacked"])
def test_a_sharded_checkpoint_restores_into_every_layout(tmp_path, into):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, jdp.broadcast(busy_state(4), shard_optimizer=True))
    template = {"sharded": lambda s: jdp.broadcast(s, shard_optimizer=True),
                "unsharded": jdp.broadcast, "stacked": jdp.replicate}[into](make_state(9))
    restored = ckpt.restore(template)
    if into == "stacked":
        restored = jdp.unreplicate(restored)
    assert_saved_values(restored)
    if into == "sharded":
        assert_sharded(restored)


def test_an_unsharded_checkpoint_restores_sharded(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, jdp.broadcast(busy_state(4)))
    restored = ckpt.restore(jdp.broadcast(make_state(9), shard_optimizer=True))
    assert_saved_values(restored)
    assert_sharded(restored)


def test_8_devices_sharded_to_2_devices_unsharded_and_sharded_and_back(tmp_path):
    Checkpointer(tmp_path).save(1, jdp.broadcast(busy_state(4), shard_optimizer=True))
    out = tmp_path / "on2.npz"
    proc = run_python([CHILD, "zero_roundtrip", str(tmp_path), str(out)],
                      env=child_env(devices=2), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = np.load(out)
    for name, want in SAVED.items():
        for label in ("unsharded", "sharded"):
            value = got[f"{label}{name}"]
            assert value.shape == want.shape and value.tobytes() == want.tobytes(), (label, name)
        spec = re.findall(r"None|'batch'", str(got[f"spec{name}"]))   # e.g. P(None, 'batch')
        spec = ["batch" if s == "'batch'" else None for s in spec]      # split for 2 devices
        assert_split(name, want.shape, spec, 2)
    back = Checkpointer(tmp_path / "back").restore(
        jdp.broadcast(make_state(9), shard_optimizer=True))
    assert_saved_values(back)
    assert_sharded(back)
