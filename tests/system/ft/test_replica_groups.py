"""Replica groups on torchft (`jdp.ft`), each group its own jdp job started here without a
launcher: with every group present they train as single-device optax on the concatenated
batches of the groups (replicated or ZeRO inside a group)."""
import pytest
from conftest import finish
from ft_groups import check_against_replay, start_group

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
