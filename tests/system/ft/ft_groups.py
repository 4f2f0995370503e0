"""Replica groups of `examples/fault_tolerant.py` started here without a launcher, each group
its own jdp job (the tests that need no restarts)."""
import subprocess
import sys

import ft_replay
import numpy as np
from conftest import REPO, child_env, free_port

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


def check_streaming_against_replay(tmp_path, groups, every, fragments, outer=None,
                                   processes=1) -> list:
    """Every group ends with the same bits, those of Streaming LocalSGD (`outer` None) or
    DiLoCo (`outer`, an optax optimizer) replayed on one device on the syncs the records
    show (1e-6). Returns the record (`ft_replay.commits`)."""
    import fault_tolerant as example

    from jdp.ft._outer import Outer
    record = ft_replay.commits([ft_replay.events(tmp_path / f"ev{g}.jsonl")
                                for g in range(groups)])
    parts = Outer(every, None, fragments).parts(example.init_params(WIDTH))
    want = ft_replay.replay_streaming(record, groups, BATCH, WIDTH, LR, parts, outer,
                                      processes)
    finals = [np.load(tmp_path / f"p{g}.npz") for g in range(groups)]
    for name, value in want.items():
        for final in finals:
            assert final[name].tobytes() == finals[0][name].tobytes(), name   # groups agree
        np.testing.assert_allclose(finals[0][name], value, atol=1e-6, rtol=0)
    return record
