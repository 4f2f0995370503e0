"""HSDP in jobs that no jdp launcher started: Open MPI's `mpirun -np 2` and SLURM's
`srun -n 2`, each process with 2 simulated devices on this one machine (one node).

`shard_params=2` splits the model within each process's 2 devices and replicates it across the
two processes; the step must train as single-device optax, with only the gradient shards'
all-reduce crossing processes. `shard_params="node"` must take the node's process count from the
engine (OMPI_COMM_WORLD_LOCAL_SIZE, SLURM_TASKS_PER_NODE): both processes, so every device.
Each test skips where its engine is absent (CI installs them for its extras phase).
"""
import subprocess
import sys

import pytest
import test_fsdp_layers
from conftest import MPIRUN, REPO, child_env, mpirun_command, wait_until_gone, write_script
from test_fault_slurm import SRUN, slurm_ready
from test_hsdp import NODES, assert_node_job

DEVICES = 2


def scripts(tmp_path) -> tuple[str, str]:
    return (write_script(tmp_path, "nodes.py", NODES),
            write_script(tmp_path, "common.py", test_fsdp_layers.COMMON))


@pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI, Debian package openmpi-bin) is "
                    "not installed")
def test_hsdp_under_mpirun_splits_within_a_process_and_node_spans_the_host(tmp_path, tag):
    script, common = scripts(tmp_path)
    env = child_env(DEVICES, JDP_TEST_TAG=tag, SHARD=str(DEVICES))
    cmd = mpirun_command(script, ("JAX_PLATFORMS", "PYTHONPATH", "JDP_TEST_TAG", "XLA_FLAGS",
                                  "SHARD"), tmp_path, common)
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert_node_job(tmp_path, processes=2, devices=DEVICES, k=DEVICES)
    assert wait_until_gone(tag, timeout=5.0) < 5.0


@pytest.mark.skipif(not slurm_ready(), reason="no running SLURM (srun, sinfo with an idle "
                    "node; Debian package slurm-wlm)")
def test_hsdp_under_srun_splits_within_a_process_and_node_spans_the_host(tmp_path, tag):
    script, common = scripts(tmp_path)
    env = child_env(DEVICES, JDP_TEST_TAG=tag, SHARD=str(DEVICES))
    done = subprocess.run([SRUN, "-n", "2", "--overcommit", sys.executable, script,
                           str(tmp_path), common], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert_node_job(tmp_path, processes=2, devices=DEVICES, k=DEVICES)
    assert wait_until_gone(tag, timeout=5.0) < 5.0
