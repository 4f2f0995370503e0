"""Semi-synchronous replica groups (`jdp.ft.Replicas(..., sync_every=H, outer=...)`), three
groups started here without a launcher: LocalSGD and DiLoCo equal a single-device replay of
their recorded syncs; LocalSGD syncing every step is the synchronous mode; DiLoCo whose outer
optimizer is SGD(1) is LocalSGD; a group's own layout (FSDP) changes nothing. The kills:
test_kills.py."""
import contextlib

import ft_replay
import numpy as np
import optax
import pytest
from conftest import finish
from ft_groups import BATCH, LR, WIDTH, check_streaming_against_replay, start_group

pytest.importorskip("torchft")
GROUPS = 3


def run(tmp_path, lighthouse, args, processes=1):
    """The three groups' final parameters (the same bits on each) and their records."""
    tmp_path.mkdir(exist_ok=True)
    procs = [p for g in range(GROUPS)
             for p in start_group(tmp_path, lighthouse, g, GROUPS, [str(a) for a in args],
                                  processes=processes, devices=2 if processes == 1 else 1)]
    logs = finish(procs, timeout=240)
    assert [p.returncode for p in procs] == [0] * len(procs), logs
    finals = [np.load(tmp_path / f"p{g}.npz") for g in range(GROUPS)]
    for name in finals[0].files:   # one model at the end: the same bits on every group
        assert all(f[name].tobytes() == finals[0][name].tobytes() for f in finals), name
    events = [ft_replay.events(tmp_path / f"ev{g}.jsonl") for g in range(GROUPS)]
    return finals[0], events


@contextlib.contextmanager
def another_lighthouse():
    """A second job's own Lighthouse (the fixture's holds the first job's groups)."""
    from jdp.ft import lighthouse as lh
    server = lh.start(0)
    try:
        yield lh.address(server, "127.0.0.1")
    finally:
        server.shutdown()


@pytest.mark.parametrize("outer, layout", [("localsgd", []), ("diloco", ["--shard_params", 2])],
                         ids=["localsgd-replicated", "diloco-fsdp"])
def test_groups_train_as_a_replay_of_their_recorded_syncs(tmp_path, lighthouse, outer,
                                                          layout):
    steps, every = 23, 5   # the run's end syncs in place of step 20's sync: a round of 8
    final, events = run(tmp_path, lighthouse, ["--steps", steps, "--sync_every", every,
                                               "--optimizer", "sgd", "--outer", outer,
                                               *layout])
    record = ft_replay.syncs(events)
    assert record == {1: ([0, 1, 2], 0), **{c + 2: ([0, 1, 2], at)
                                            for c, at in enumerate([5, 10, 15, steps])}}
    tx = optax.sgd(0.7, momentum=0.9, nesterov=True) if outer == "diloco" else None
    want = ft_replay.replay_syncs(record, GROUPS, BATCH, WIDTH, LR, tx)
    for name, value in want.items():
        np.testing.assert_allclose(final[name], value, atol=1e-6, rtol=0)


def test_localsgd_every_step_is_the_synchronous_mode(tmp_path, lighthouse):
    """Averaging the parameters after each SGD step is averaging the gradients before it."""
    common = ["--steps", 12, "--optimizer", "sgd"]
    local, _ = run(tmp_path / "local", lighthouse, [*common, "--sync_every", 1])
    with another_lighthouse() as fresh:
        sync, events = run(tmp_path / "sync", fresh, common)
    assert set(ft_replay.history(events)) == set(range(1, 13))
    for name in sync.files:
        np.testing.assert_allclose(local[name], sync[name], atol=1e-6, rtol=0)


def test_diloco_whose_outer_step_is_sgd_1_is_localsgd(tmp_path, lighthouse):
    common = ["--steps", 20, "--sync_every", 4, "--optimizer", "sgd"]
    local, _ = run(tmp_path / "local", lighthouse, [*common, "--outer", "localsgd"])
    with another_lighthouse() as fresh:
        diloco, _ = run(tmp_path / "diloco", fresh,
                        [*common, "--outer", "diloco", "--outer_lr", 1, "--outer_momentum", 0])
    for name in local.files:
        np.testing.assert_allclose(diloco[name], local[name], atol=1e-6, rtol=0)


@pytest.mark.parametrize("outer, processes", [("diloco", 1), ("localsgd", 2)],
                         ids=["diloco", "localsgd-2-processes"])
def test_streaming_fragments_overlapped_equal_a_replay(tmp_path, lighthouse, outer, processes):
    """Streaming (`--fragments 2 --overlap 2`, H = 8): each fragment synced every 8 steps,
    staggered by 4, merged 2 steps after it was sent; at the end every fragment synced, in
    place of the regular syncs after which the run ends within 8 steps (16 and 20);
    in groups of one process (2 devices) and of two (1 device each: every process sends its
    own pieces, the sync's exchange spans processes)."""
    steps, every, fragments, overlap = 22, 8, 2, 2
    run(tmp_path, lighthouse, [
        "--steps", steps, "--sync_every", every, "--fragments", fragments, "--overlap",
        overlap, "--optimizer", "sgd", "--outer", outer], processes=processes)
    tx = optax.sgd(0.7, momentum=0.9, nesterov=True) if outer == "diloco" else None
    record = check_streaming_against_replay(tmp_path, GROUPS, every, fragments, tx, processes)
    sends = [(inner, merged, f) for _, inner, merged, f in record[1:]]
    assert sends == [(4, 6, 0), (8, 10, 1), (12, 14, 0), (22, 22, 0), (22, 22, 1)], sends
