"""A checkpoint holds one logical copy: it restores bitwise into the global or the stacked
layout, whichever layout saved it, on 8 devices, 2 devices, and 2 processes x 2 devices."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _checkpoint_child import busy_state, global_state, host_leaves, make_state
from conftest import REPO, child_env, run_python, run_ranks

import jdp
from jdp.checkpoint import Checkpointer
from jdp.core import replicated

CHILD = os.path.join(REPO, "tests", "system", "checkpoint", "_checkpoint_child.py")
N = jax.local_device_count()
# The values every test saves, as numpy arrays of the dtypes a device holds (step: int32).
SAVED = {k: np.asarray(jnp.asarray(v)) for k, v in host_leaves(make_state(4)).items()}


def assert_global(state, want=SAVED):
    """Every leaf a global array, fully replicated on jdp's mesh, equal to `want` bitwise."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(path)
        assert leaf.sharding == replicated() and leaf.shape == want[name].shape, name
        assert len(leaf.addressable_shards) == N, name
        for shard in leaf.addressable_shards:
            assert np.asarray(shard.data).tobytes() == want[name].tobytes(), name


def assert_stacked(state, want=SAVED):
    """Every leaf [N, ...], one bitwise copy of `want` per local device."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(path)
        assert leaf.shape == (N, *want[name].shape), name
        for shard in leaf.addressable_shards:
            assert np.asarray(shard.data)[0].tobytes() == want[name].tobytes(), name


@pytest.mark.parametrize("saved_as", ["global", "stacked"])
def test_either_layout_restores_bitwise_into_both(tmp_path, saved_as):
    state = global_state(make_state(4)) if saved_as == "global" else jdp.replicate(make_state(4))
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, state)
    template = global_state(make_state(9))
    restored = ckpt.restore(template)
    assert restored.apply_fn is template.apply_fn and restored.tx is template.tx
    assert_global(restored)
    assert_stacked(ckpt.restore(jdp.replicate(make_state(9))))


def test_a_global_state_is_written_once_not_once_per_device(tmp_path):
    # 1 MiB of random (incompressible) bytes: eight copies would be 8 MiB.
    big = {"w": np.random.default_rng(0).integers(0, 1 << 32, 1 << 18, dtype=np.uint32)}
    Checkpointer(tmp_path).save(1, global_state(big))
    written = sum(os.path.getsize(os.path.join(d, f))
                  for d, _, files in os.walk(tmp_path / "1") for f in files)
    assert big["w"].nbytes <= written < 1.5 * big["w"].nbytes


def test_a_global_checkpoint_from_8_devices_restores_on_2_in_both_layouts(tmp_path):
    Checkpointer(tmp_path / "ckpt").save(3, global_state(make_state(4)))
    out = tmp_path / "restored.npz"
    proc = run_python([CHILD, "restore_both", str(tmp_path / "ckpt"), str(out)],
                      env=child_env(devices=2), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = np.load(out)
    for name, want in SAVED.items():
        assert got[f"global_{name}"].shape == (2, *want.shape), name  # 2 devices, 1 copy each
        assert got[f"global_{name}.replicated"], name
        assert got[f"stacked{name}"].shape == (2, 1, *want.shape), name
        for copy in (*got[f"global_{name}"], *got[f"stacked{name}"][:, 0]):
            assert copy.tobytes() == want.tobytes(), name


def test_two_processes_save_a_global_state_that_restores_anywhere(tmp_path):
    directory, out = tmp_path / "ckpt", tmp_path / "result"
    codes, logs = run_ranks([CHILD, "two_process_global", directory, out], timeout=120,
                            JDP_SHUTDOWN_TIMEOUT="30")
    assert codes == [0, 0], logs
    for rank in range(2):
        got = np.load(f"{out}.{rank}.npz")
        for name, want in SAVED.items():
            assert got[f"global_{name}.replicated"], name
            for copy in (*got[f"global_{name}"], *got[f"stacked{name}"][:, 0]):
                assert copy.tobytes() == want.tobytes(), (rank, name)
    # ... and on this single process with 8 devices, in both layouts.
    ckpt = Checkpointer(directory)
    assert_global(ckpt.restore(global_state(make_state(9))))
    assert_stacked(ckpt.restore(jdp.replicate(make_state(9))))
    # ZeRO's optimizer state sharded over the 2 processes: unsharded on each, and here sharded.
    busy = {k: np.asarray(jnp.asarray(v)) for k, v in host_leaves(busy_state(4)).items()}
    for rank in range(2):
        got = np.load(f"{out}.zero.{rank}.npz")
        for name, want in busy.items():
            assert got[name].tobytes() == want.tobytes(), (rank, name)
    assert_global(Checkpointer(directory / "async").restore(global_state(make_state(9))))
    assert sorted(set(os.listdir(directory / "async")) - {".jdp-writer"}) == ["7"]
    sharded = Checkpointer(directory / "zero").restore(
        jdp.broadcast(make_state(9), shard_optimizer=True))
    for path, leaf in jax.tree_util.tree_flatten_with_path(sharded)[0]:
        want = busy[jax.tree_util.keystr(path)]
        cut = np.asarray(leaf)[tuple(slice(0, n) for n in want.shape)]
        assert cut.tobytes() == want.tobytes(), path


def test_a_global_layout_run_resumes_bitwise_after_a_restart(tmp_path):
    from test_checkpoint import dataset, train

    def loader():
        return jdp.data.Loader(dataset(), 32, layout="global",
                               sampler=jdp.data.DistributedSampler(96, shuffle=True, seed=3))

    straight = train(jdp.broadcast(make_state()), loader(), 2, make_step=jdp.train_step)
    first = loader()
    Checkpointer(tmp_path).save(2, train(jdp.broadcast(make_state()), first, 2, stop=(2, True),
                                         make_step=jdp.train_step), loader=first)
    second = loader()  # a restarted process: fresh state (other values), loader, checkpointer
    resumed = train(Checkpointer(tmp_path).restore(jdp.broadcast(make_state(seed=5)),
                                                   loader=second), second, 2,
                    make_step=jdp.train_step)
    want = host_leaves(straight)
    for name, got in host_leaves(resumed).items():
        assert got.tobytes() == want[name].tobytes(), name
