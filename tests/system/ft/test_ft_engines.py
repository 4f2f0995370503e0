"""A replica group that no jdp launcher started: group 1 under Open MPI's `mpirun -np 2` or
SLURM's `srun -n 2` (the job sets JDP_REPLICA_GROUP, JDP_REPLICA_GROUPS and
JDP_FT_LIGHTHOUSE itself), beside group 0 under `jdp.launch` with the Lighthouse. Both groups
of 2 processes x 1 device (FSDP across the two) train as single-device optax on their
concatenated batches; semi-synchronous groups (Streaming LocalSGD) as a single-device replay
of their recorded syncs."""
import subprocess
import sys
import time

import pytest
from conftest import (
    MPIRUN,
    REPO,
    child_env,
    free_port,
    job_env,
    mpirun_command,
    start_launcher,
)
from ft_groups import (
    BATCH,
    EXAMPLE,
    LR,
    WIDTH,
    check_against_replay,
    check_streaming_against_replay,
)
from test_fault_slurm import SRUN, slurm_ready

pytest.importorskip("torchft")
STEPS = 20
ARGS = ["--steps", str(STEPS), "--batch_size", str(BATCH), "--width", str(WIDTH),
        "--lr", str(LR), "--shard_params", "2"]
# Streaming LocalSGD: a fragment of two synced every 2 steps, merged 1 step after it was sent
STREAMING = ["--sync_every", "4", "--fragments", "2", "--overlap", "1", "--optimizer", "sgd",
             "--outer", "localsgd"]
MODES = {"synchronous": [], "streaming": STREAMING}


def run_beside_a_launched_group(tmp_path, tag, engine_command, mode="synchronous") -> None:
    port = free_port()
    out = open(tmp_path / "launcher.log", "w")
    launcher = start_launcher(
        ["--nproc_per_node", 2, "--devices_per_process", 1, "--replica_group", 0,
         "--replica_groups", 2, "--ft_lighthouse", f"start:{port}", "--logdir", tmp_path / "g0",
         EXAMPLE, *ARGS, *MODES[mode], "--out", tmp_path / "p0.npz"],
        job_env(tag, RUST_LOG="warn"),
        stdout=out, stderr=out)
    time.sleep(3)   # the Lighthouse comes up with the launcher
    env = child_env(1, JDP_TEST_TAG=tag, RUST_LOG="warn", JDP_REPLICA_GROUP="1",
                    JDP_REPLICA_GROUPS="2", JDP_FT_LIGHTHOUSE=f"127.0.0.1:{port}",
                    JDP_FT_EVENTS=str(tmp_path / "ev1.jsonl"))
    try:
        done = subprocess.run(engine_command(env), env=env, cwd=REPO, capture_output=True,
                              text=True, timeout=300)
        code = launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert code == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    (tmp_path / "ev0.jsonl").write_text((tmp_path / "g0" / "ft_events.jsonl").read_text())
    if mode == "synchronous":
        assert len(check_against_replay(tmp_path, 2, processes=2)) == STEPS
    else:   # every 2 steps a fragment, merged a step later
        record = check_streaming_against_replay(tmp_path, 2, 4, 2, processes=2)
        assert [(inner, merged) for _, inner, merged, _ in record[1:6]] == [
            (2, 3), (4, 5), (6, 7), (8, 9), (10, 11)], record


@pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI, Debian package openmpi-bin) is "
                    "not installed")
@pytest.mark.parametrize("mode", MODES)
def test_a_group_under_mpirun_trains_beside_a_launched_one(tmp_path, tag, mode):
    forward = ("JAX_PLATFORMS", "PYTHONPATH", "JDP_TEST_TAG", "XLA_FLAGS", "RUST_LOG",
               "JDP_REPLICA_GROUP", "JDP_REPLICA_GROUPS", "JDP_FT_LIGHTHOUSE", "JDP_FT_EVENTS")
    run_beside_a_launched_group(tmp_path, tag, lambda env: mpirun_command(
        EXAMPLE, forward, *ARGS, *MODES[mode], "--out", tmp_path / "p1.npz"), mode)


@pytest.mark.skipif(not slurm_ready(), reason="no running SLURM (srun, sinfo with an idle "
                    "node; Debian package slurm-wlm)")
@pytest.mark.parametrize("mode", MODES)
def test_a_group_under_srun_trains_beside_a_launched_one(tmp_path, tag, mode):
    run_beside_a_launched_group(tmp_path, tag, lambda env: [
        SRUN, "-n", "2", "--overcommit", sys.executable, EXAMPLE, *ARGS, *MODES[mode],
        "--out", str(tmp_path / "p1.npz")], mode)
