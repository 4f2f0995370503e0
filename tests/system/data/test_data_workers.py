"""Loader(num_workers=k): the batches of k = 0 for every k, replayable augmentation, exact
resume, errors that name the example, and workers that end on every exit path.

Worker loaders start processes (about 2 s each), so each test builds as few as it can.
"""
import gc
import json
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, child_env

from jdp.data import DistributedSampler, Loader

N, BATCH, WORLD, SEED = 203, 32, 2, 5


class Source:
    """Example i: {"x": [i, i/2] as float32, "id": i}; read one example at a time."""

    def __init__(self, bad=None):
        self.bad = bad  # this example's read raises

    def __len__(self):
        return N

    def __getitem__(self, i):
        if i == self.bad:
            raise KeyError(f"record {i} is corrupt")
        return {"x": np.array([i, i / 2], np.float32), "id": np.int64(i)}


def augment(batch, rng):
    """Random shift per example: x + one normal draw of the example's own generator."""
    noise = np.array([g.normal() for g in rng], np.float32)
    return {"x": batch["x"] + noise[:, None], "id": batch["id"]}


def expected_x(ids, epoch):
    """Independent: the documented seeding rule, (seed, epoch, example index)."""
    noise = [np.random.default_rng([SEED, epoch, int(i)]).normal() for i in ids]
    base = np.stack([ids, ids / 2], 1).astype(np.float32)
    return base + np.asarray(noise, np.float32)[:, None]


def make(workers, rank=0, batch=BATCH, bad=None, **kwargs):
    sampler = DistributedSampler(N, num_replicas=WORLD, rank=rank, shuffle=True, seed=SEED)
    return Loader(Source(bad), batch, sampler=sampler, transform=augment, num_workers=workers,
                  **kwargs)


def host(batches):
    return [{k: np.asarray(v) for k, v in b.items()} for b in batches]


def alive(pids):
    """The pids that still run (zombies count as dead). A process may end between two looks at
    it, so any lookup that finds it gone means gone."""
    import psutil
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_dead(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(pids)


def test_every_worker_count_gives_the_same_batches_and_the_documented_augmentation():
    runs = {}
    for k in (0, 1, 2):
        loader = make(k, rank=1)
        runs[k] = [host(loader) for _ in range(2)]  # epochs 0 and 1
        loader.close()
    sampler = DistributedSampler(N, num_replicas=WORLD, rank=1, shuffle=True, seed=SEED)
    for epoch, batches in enumerate(runs[0]):
        sampler.set_epoch(epoch)
        order = sampler.indices()
        rows = np.concatenate([b["id"].reshape(-1) for b in batches])
        np.testing.assert_array_equal(rows[:len(order)], order)
        xs = np.concatenate([b["x"].reshape(-1, 2) for b in batches])
        np.testing.assert_allclose(xs, expected_x(rows, epoch), rtol=0, atol=0)
    for k in (1, 2):
        for got, want in zip(runs[k], runs[0], strict=True):
            assert len(got) == len(want) == 4
            for g, w in zip(got, want, strict=True):
                for key in ("x", "id", "mask"):
                    np.testing.assert_array_equal(g[key], w[key])


def test_resume_mid_epoch_with_workers_and_random_transform_is_bitwise():
    reference = host(make(0))
    first = make(2)
    taken = []
    for batch in first:
        taken += host([batch])
        if first.step == 2:
            break
    saved = json.loads(json.dumps(first.state_dict()))
    first.close()
    resumed = make(1)
    resumed.load_state_dict(saved)
    rest = host(resumed)
    resumed.close()
    assert len(taken + rest) == len(reference)
    for g, w in zip(taken + rest, reference, strict=True):
        for key in ("x", "id", "mask"):
            np.testing.assert_array_equal(g[key], w[key])
    assert saved["step"] == 2 and (resumed.epoch, resumed.step) == (1, 0)


def test_workers_end_on_close_on_garbage_collection_and_after_break():
    loader = make(2, prefetch=1)
    for _ in loader:
        break
    pids = loader._pool.pids()
    assert len(alive(pids)) == 2
    time.sleep(2.5)  # idle workers wait (a long eval or checkpoint between passes)
    assert len(list(loader)) == 3  # the rest of the epoch, after the break, same workers
    assert loader._pool.pids() == pids
    loader.close()
    assert wait_dead(pids) == []

    loader = make(1)
    next(iter(loader))
    pids = loader._pool.pids()
    del loader
    gc.collect()
    assert wait_dead(pids) == []


def test_an_error_in_a_worker_names_the_example_and_a_killed_worker_names_its_batch():
    loader = make(2, bad=77)
    sampler = DistributedSampler(N, num_replicas=WORLD, rank=0, shuffle=True, seed=SEED)
    bad_batch = int(np.flatnonzero(sampler.indices() == 77)[0]) // BATCH
    with pytest.raises(RuntimeError, match=r"example index 77 .*KeyError"):
        for _ in loader:
            pass
    assert loader.step == bad_batch
    loader.close()

    loader = make(2, prefetch=0, batch=8)  # 13 batches: worker 1 owes some when killed
    batches = iter(loader)
    next(batches)
    victim = loader._pool.pids()[1]
    os.kill(victim, signal.SIGKILL)
    # The batch it owed is named when the kill caught it building one; a worker killed after
    # it had written everything asked of it so far dies "between batches".
    with pytest.raises(RuntimeError, match=r"worker 1 \(pid \d+\) died with exit code -9 "
                                           r"(while building batch \d+ \(example indices|"
                                           r"between batches)"):
        for _ in batches:
            pass
    del batches
    step = loader.step
    rest = host(loader)  # a fresh pool serves the rest of the epoch
    loader.close()
    want = host(make(0, batch=8))[step:]
    assert [b["id"].tolist() for b in rest] == [b["id"].tolist() for b in want]


def test_a_lambda_transform_with_workers_is_refused_at_construction():
    with pytest.raises(TypeError, match=r"num_workers=2 .*transform.*module level"):
        Loader(Source(), BATCH, transform=lambda b: b, num_workers=2)


_ORPHAN_SCRIPT = """
import sys, time, numpy as np
sys.path[:0] = {paths!r}   # this module and the conftest it imports
from test_data_workers import make
if __name__ == "__main__":
    loader = make(2)
    it = iter(loader)
    next(it)
    print(" ".join(map(str, loader._pool.pids())), flush=True)
    time.sleep(60)
"""


def test_workers_of_a_killed_parent_exit_on_their_own(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(_ORPHAN_SCRIPT.format(
        paths=[os.path.dirname(os.path.abspath(__file__)), os.path.join(REPO, "tests")]))
    # TMPDIR: the killed parent cannot remove its multiprocessing directory; keep it here.
    parent = subprocess.Popen([sys.executable, str(script)],
                              env=child_env(devices=8, TMPDIR=str(tmp_path)),
                              stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 60)
        assert ready, "the parent did not start its workers within 60 s"
        line = parent.stdout.readline()  # printed after its workers answered
        pids = [int(p) for p in line.split()]
        assert len(alive(pids)) == 2, line
    finally:
        parent.kill()
        parent.wait(timeout=10)
        parent.stdout.close()
    assert wait_dead(pids, timeout=10) == []


def test_a_large_in_memory_source_passes_the_picklability_check_without_starting_workers():
    big = {"x": np.zeros((1000, 1000), np.float32), "id": np.arange(1000)}  # 4 MB: out-of-band
    loader = Loader(big, BATCH, num_workers=2)
    assert loader._pool is None  # workers start at the first iteration
