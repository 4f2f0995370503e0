"""jdp.checkpoint.Checkpointer: bitwise resume, atomic saves, other device counts, 2 processes."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _checkpoint_child import Net, host_leaves, make_state
from conftest import REPO, child_env, run_python, run_ranks

import jdp
from jdp.checkpoint import Checkpointer
from jdp.data import DistributedSampler, Loader

CHILD = os.path.join(REPO, "tests", "system", "checkpoint", "_checkpoint_child.py")
N = jax.local_device_count()


def make_loader():
    """The Loader a (re)started process builds: shuffled, 3 batches of 32 per epoch, in the
    pmap form (the state these tests train is stacked)."""
    return Loader(dataset(), 32, sampler=DistributedSampler(96, shuffle=True, seed=3),
                  layout="pmap")


def dataset(n=96):
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(n, 8)).astype(np.float32),
            "y": rng.integers(0, 3, size=n).astype(np.int32),
            "idx": np.arange(n, dtype=np.int32)}


def loss_fn(params, batch, model_state, rng):
    logits, updates = Net().apply({"params": params, "batch_stats": model_state}, batch["x"],
                                  rngs={"dropout": rng}, mutable=["batch_stats"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    mask = batch["mask"].astype(jnp.float32)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0), updates["batch_stats"]


def train(state, loader, num_epochs, stop=(None, True), seen=None,
          make_step=jdp.pmap.train_step):
    """The resumable loop of DESIGN.md, recording the examples of each batch in `seen`.

    `stop=(k, inside)` returns after k batches: from inside the batch loop (where a save every
    k steps happens), or else once the epoch's batch loop has ended (a save per epoch).
    `make_step`: `jdp.pmap.train_step` for a stacked state, `jdp.train_step` for a global one.
    """
    step, done, (stop_after, inside) = make_step(loss_fn), 0, stop
    for epoch in range(loader.epoch, num_epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            state, _ = step(state, batch)
            if seen is not None:
                seen.append(np.asarray(batch["idx"]).ravel().tolist())
            done += 1
            if done == stop_after and inside:
                return state
        if done == stop_after:
            return state
    return state


@pytest.fixture(scope="module")
def straight_run():
    """Two epochs without interruption: the reference for every resume."""
    seen = []
    state = train(jdp.replicate(make_state()), make_loader(), 2, seen=seen)
    return host_leaves(jdp.unreplicate(state)), seen


@pytest.mark.parametrize("stop", [
    pytest.param((1, True), id="mid_epoch"),
    pytest.param((3, True), id="after_last_batch", marks=pytest.mark.long),
    pytest.param((3, False), id="after_epoch_loop", marks=pytest.mark.long)])
def test_resume_after_restart_is_bitwise_equal_to_a_straight_run(tmp_path, straight_run, stop):
    ref_leaves, ref_seen = straight_run
    loader = make_loader()
    state = train(jdp.replicate(make_state()), loader, 2, stop=stop)
    batches_before_save = stop[0]
    Checkpointer(tmp_path).save(batches_before_save, state, loader=loader)
    del state, loader
    # What a restarted process builds: fresh state (other init values), loader, checkpointer.
    loader, seen = make_loader(), []
    state = Checkpointer(tmp_path).restore(jdp.replicate(make_state(seed=5)), loader=loader)
    state = train(state, loader, 2, seen=seen)
    assert seen == ref_seen[batches_before_save:]
    got = host_leaves(jdp.unreplicate(state))
    assert got.keys() == ref_leaves.keys()
    for path, ref in ref_leaves.items():
        assert np.array_equal(got[path], ref), path


def test_restore_puts_each_leaf_on_every_device_like_the_template(tmp_path):
    saved = jdp.replicate(make_state(1))
    ckpt = Checkpointer(tmp_path)
    ckpt.save(7, saved)
    template = jdp.replicate(make_state(2))
    restored = ckpt.restore(template)
    assert restored.apply_fn == template.apply_fn and restored.tx is template.tx
    want = host_leaves(make_state(1))
    pairs = zip(jax.tree_util.tree_flatten_with_path(restored)[0],
                jax.tree_util.tree_flatten_with_path(template)[0], strict=True)
    for (path, leaf), (_, tleaf) in pairs:
        assert leaf.sharding == tleaf.sharding and leaf.dtype == tleaf.dtype
        for shard in leaf.addressable_shards:
            assert np.array_equal(shard.data[0], want[jax.tree_util.keystr(path)])


def test_empty_directory_restore_returns_the_state_unchanged(tmp_path):
    ckpt, state, loader = Checkpointer(tmp_path / "new"), jdp.replicate({"w": np.ones(3)}), \
        make_loader()
    batches = iter(loader)
    next(batches), next(batches)
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    assert ckpt.restore(state, loader=loader) is state
    assert (loader.epoch, loader.step) == (0, 2)


def test_only_the_newest_max_to_keep_checkpoints_remain(tmp_path):
    ckpt = Checkpointer(tmp_path, max_to_keep=2)
    for step in (10, 20, 30, 40):
        ckpt.save(step, jdp.replicate({"w": np.full(3, step, np.float32)}))
    assert ckpt.all_steps() == [30, 40] and ckpt.latest_step() == 40
    assert sorted(set(os.listdir(tmp_path)) - {".jdp-writer"}) == ["30", "40"]
    older = ckpt.restore(jdp.replicate({"w": np.zeros(3, np.float32)}), step=30)
    assert np.array_equal(np.asarray(older["w"]), np.full((N, 3), 30, np.float32))


def _mismatch(tmp_path, template):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, jdp.replicate(make_state()))
    with pytest.raises(ValueError) as info:
        ckpt.restore(jdp.replicate(template))
    return str(info.value)


def test_a_different_shape_is_named_by_its_path(tmp_path):
    message = _mismatch(tmp_path, make_state(hidden=12))
    # The first leaf in the state's order (TrainState fields: step, params, ...) that differs.
    assert message.endswith(
        "params/BatchNorm_0/bias: checkpoint has shape (16,), state has (12,)")


def test_a_leaf_missing_from_the_checkpoint_is_named(tmp_path):
    state = make_state()
    message = _mismatch(tmp_path, state.replace(params={**state.params, "extra": jnp.ones(2)}))
    assert "missing in checkpoint: params/extra" in message


def test_a_leaf_missing_from_the_state_is_named(tmp_path):
    state = make_state()
    message = _mismatch(tmp_path, state.replace(model_state={}))
    assert "in checkpoint but not in state: model_state/BatchNorm_0/mean" in message


def test_save_refuses_what_it_cannot_resume_from(tmp_path):
    ckpt, state = Checkpointer(tmp_path), jdp.replicate({"w": np.ones(3, np.float32)})
    ckpt.save(5, state)
    with pytest.raises(ValueError, match="step 5 is not after the latest checkpoint 5"):
        ckpt.save(5, state)
    with pytest.raises(ValueError, match=r"no checkpoint for step 4 .* saved steps: \[5\]"):
        ckpt.restore(state, step=4)
    with pytest.raises(ValueError, match="holds no loader position"):
        ckpt.restore(state, loader=make_loader())


def test_kill_9_before_the_final_rename_leaves_the_previous_checkpoint_latest(tmp_path):
    directory, marker = tmp_path / "ckpt", tmp_path / "marker"
    child = subprocess.Popen([sys.executable, CHILD, "hang_in_rename", str(directory),
                              str(marker)], env=child_env(devices=1), cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        reached = marker.exists()
        child.send_signal(signal.SIGKILL)
        log = child.communicate(timeout=10)[0]
    finally:
        if child.poll() is None:
            child.kill()
    assert reached, f"the child never reached the rename:\n{log}"
    assert child.returncode == -signal.SIGKILL
    # Step 2 is fully written (commit file included) but was never renamed.
    tmp_dirs = glob.glob(str(directory / "2.orbax-checkpoint-tmp*"))
    assert tmp_dirs and os.path.exists(os.path.join(tmp_dirs[0], "commit_success.txt"))
    ckpt = Checkpointer(directory)
    assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
    restored = host_leaves(jdp.unreplicate(ckpt.restore(jdp.replicate(make_state(9)))))
    for path, want in host_leaves(make_state(1)).items():  # 1 device -> 8 devices
        assert np.array_equal(restored[path], want), path
    # Opening and restoring never deletes (it could be a live writer's save); the next save
    # is by a writer, which cleans what a crashed writer left.
    assert glob.glob(str(directory / "2.orbax-checkpoint-tmp*")) == tmp_dirs
    ckpt.save(2, jdp.replicate(make_state(2)))  # the restarted job saves step 2 again
    assert ckpt.all_steps() == [1, 2]
    assert not glob.glob(str(directory / "*tmp*"))


def test_a_checkpoint_saved_on_8_devices_restores_on_2(tmp_path):
    state = jdp.replicate(make_state(4))
    Checkpointer(tmp_path / "ckpt").save(3, state)
    out = tmp_path / "restored.npz"
    proc = run_python([CHILD, "restore", str(tmp_path / "ckpt"), str(out)],
                      env=child_env(devices=2), timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    restored = np.load(out)
    for path, want in host_leaves(make_state(4)).items():
        assert restored[path].shape == (2, *want.shape), path
        assert np.array_equal(restored[path][0], want) and np.array_equal(restored[path][1], want)


def test_two_processes_save_one_copy_and_restore_the_same_values(tmp_path):
    directory, out = tmp_path / "ckpt", tmp_path / "result"
    codes, logs = run_ranks([CHILD, "two_process", directory, out], timeout=90,
                            JDP_SHUTDOWN_TIMEOUT="30")
    assert codes == [1, 1], logs   # the last save is process 0's alone: named, not a hang
    for log in logs:
        assert ("Checkpointer.save: process(es) 1 skipped this call (call 5), which process 0 "
                "waits in: process 1 finished its script") in log, log
    results = [json.loads((tmp_path / f"result.{rank}").read_text()) for rank in range(2)]
    process0 = np.arange(6, dtype=np.float32).reshape(2, 3)  # what process 0 held
    for r in results:
        assert r["empty_latest"] is None and r["steps_after_save"] == [2, 3]
        assert np.array_equal(r["w"], [[process0], [process0]]) and r["step"] == [7, 7]
        assert r["loader"] == [0, 1]  # process 0's position, on both
        assert ("disagree on the step: 4 on process(es) 0 but 5 on process(es) 1"
                in r["different_steps_error"]), r["different_steps_error"]
    step_dir = directory / "3" / "state"
    assert sorted(p.name for p in step_dir.glob("ocdbt.process_*")) == ["ocdbt.process_0"]


def test_import_jdp_does_not_import_orbax():
    # orbax takes about half a second to import: only a Checkpointer loads it.
    code = ("import jdp, sys; loaded = [m for m in sys.modules if 'orbax' in m]; "
            "assert not loaded, loaded")
    proc = run_python(["-c", code], env=child_env(devices=1), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
