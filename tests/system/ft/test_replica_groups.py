"""Replica groups on torchft (`jdp.ft`), each group its own jdp job started here without a
launcher: with every group present they train as single-device optax on the concatenated
batches of the groups (replicated or ZeRO inside a group); a group whose loop is one call
(`replicas.train`) and one that calls `train_step`'s step in `batches`' loop make the same
attempts, synchronous or semi-synchronous, and train together."""
import ft_replay
import numpy as np
import pytest
from conftest import finish
from ft_groups import BATCH, LR, WIDTH, check_against_replay, start_group
from test_ft_agreement import start

pytest.importorskip("torchft")


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


@pytest.mark.parametrize("sync", [[], ["--sync_every", 4, "--optimizer", "sgd"]],
                         ids=["every-step", "localsgd"])
def test_a_group_in_one_call_and_one_step_by_step_train_together_as_one_device(
        tmp_path, lighthouse, sync):
    """Group 0 loops with `replicas.train`, group 1 with `train_step` in `batches`
    (tests/system/ft/ft_setup.py, the example's model and data): every step (or sync) has
    both groups, and both end with the same bits, those of single-device optax replaying the
    record (1e-6)."""
    steps = 14
    procs = [p for g, form in ((0, ["--train"]), (1, []))
             for p in start(tmp_path, lighthouse, g, g, ["--steps", steps, *sync, *form,
                                                          "--out", tmp_path / f"p{g}.npz"])]
    logs = finish(procs, timeout=180)
    assert [p.returncode for p in procs] == [0, 0], logs
    if not sync:
        assert check_against_replay(tmp_path, 2) == {s: [0, 1] for s in range(1, steps + 1)}
        return
    record = ft_replay.syncs([ft_replay.events(tmp_path / f"ev{g}.jsonl") for g in range(2)])
    # the run's end (14) syncs in place of step 12's sync
    assert record == {1: ([0, 1], 0), **{c + 2: ([0, 1], at)
                                         for c, at in enumerate([4, 8, steps])}}
    want = ft_replay.replay_syncs(record, 2, BATCH, WIDTH, LR)
    finals = [np.load(tmp_path / f"p{g}.npz") for g in range(2)]
    for name, value in want.items():
        assert finals[0][name].tobytes() == finals[1][name].tobytes(), name
        np.testing.assert_allclose(finals[0][name], value, atol=1e-6, rtol=0)
