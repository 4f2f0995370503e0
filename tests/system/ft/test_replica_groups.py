"""Replica groups on torchft (`jdp.ft`), each group its own jdp job started here without a
launcher: with every group present they train as single-device optax on the concatenated
batches of the groups (replicated or ZeRO inside a group)."""
import subprocess
import sys

import ft_replay
import numpy as np
import pytest
from conftest import REPO, child_env, finish, free_port

pytest.importorskip("torchft")
EXAMPLE = f"{REPO}/examples/fault_tolerant.py"
BATCH, WIDTH, LR = 8, 32, 0.01


def start_group(tmp_path, lighthouse, group, groups, args, processes=1, devices=2):
    """The processes of one group (a jdp job of its own: its own coordinator port)."""
    port = str(free_port())
    extra = {"JDP_REPLICA_GROUP": str(group), "JDP_REPLICA_GROUPS": str(groups),
             "JDP_FT_LIGHTHOUSE": lighthouse, "JDP_FT_EVENTS": str(tmp_path / f"ev{group}.jsonl")}
    if processes > 1:
        extra.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(processes))
    return [subprocess.Popen(
        [sys.executable, EXAMPLE, "--batch_size", str(BATCH), "--width", str(WIDTH),
         "--lr", str(LR), "--out", str(tmp_path / f"p{group}.npz"), *args], cwd=REPO,
        env=child_env(devices=devices, **extra, **({"RANK": str(r)} if processes > 1 else {})),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(processes)]


def check_against_replay(tmp_path, groups, processes=1):
    history = ft_replay.history([ft_replay.events(tmp_path / f"ev{g}.jsonl")
                                 for g in range(groups)])
    want = ft_replay.replay(history, groups, BATCH, WIDTH, LR, processes)
    finals = [np.load(tmp_path / f"p{g}.npz") for g in range(groups)]
    for name, value in want.items():
        for final in finals:
            np.testing.assert_allclose(final[name], value, atol=1e-6, rtol=0)
            assert final[name].tobytes() == finals[0][name].tobytes()   # the groups agree
    return history


# FSDP across a group's processes: test_ft_engines.py (groups of 2 processes under mpirun,
# srun and jdp.launch)
@pytest.mark.parametrize("layout", [[], ["--shard_optimizer"]], ids=["replicated", "zero"])
def test_two_groups_train_as_one_device_on_their_concatenated_batches(tmp_path, lighthouse,
                                                                      layout):
    steps = 30
    procs = [p for g in range(2)
             for p in start_group(tmp_path, lighthouse, g, 2, ["--steps", str(steps), *layout])]
    logs = finish(procs, timeout=180)
    assert [p.returncode for p in procs] == [0, 0], logs
    history = check_against_replay(tmp_path, 2)
    assert history == {s: [0, 1] for s in range(1, steps + 1)}
