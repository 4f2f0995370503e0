"""Loader: global batches on the 8 simulated devices (and the pmap form), padding mask,
resumable position, prefetch thread lifetime, batched reads, errors.

Two ranks are simulated in one process by giving the sampler `rank`/`num_replicas`; both
ranks' loaders feed the same 8 local devices.
"""
import gc
import json
import threading
import time

import jax
import numpy as np
import pytest
from conftest import one_line_error

from jdp.data import DistributedSampler, Loader

N = 203          # odd: rank 1 gets one padding index, and the last batches are partial
BATCH = 32       # per process: 4 examples on each of the 8 devices
WORLD = 2


@pytest.fixture
def source():
    """Example i has id == i and x == [3i, 3i+1, 3i+2] / 7."""
    return {"x": (np.arange(N * 3, dtype=np.float32).reshape(N, 3) / 7), "id": np.arange(N)}


def make(source, rank=0, shuffle=True, seed=5, batch=BATCH, **kwargs):
    sampler = DistributedSampler(N, num_replicas=WORLD, rank=rank,
                                 shuffle=shuffle, seed=seed)
    return Loader(source, batch, sampler=sampler, **kwargs)


def ids(batches):
    """Per batch: the example ids of its real rows, in order."""
    return [np.asarray(b["id"])[np.asarray(b["mask"])].tolist() for b in batches]


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "jdp-loader-prefetch" and t.is_alive()]


def wait_no_prefetch_threads(timeout=5.0):
    deadline = time.monotonic() + timeout
    while prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return prefetch_threads()


def test_every_example_appears_once_per_epoch_across_ranks_once_padding_is_masked(source):
    seen = []
    for rank in range(WORLD):
        loader = make(source, rank=rank)
        loader.set_epoch(1)
        batches = list(loader)
        # rank 0 holds padded positions 0,2,..,202 (102 real); rank 1 1,3,..,203 (203 is padding)
        assert len(loader) == len(batches) == 4
        assert int(sum(np.asarray(b["mask"]).sum() for b in batches)) == [102, 101][rank]
        seen += [i for batch in ids(batches) for i in batch]
    assert sorted(seen) == list(range(N))


def test_by_default_leaves_are_global_arrays_sharded_along_the_axis_with_the_samplers_rows(
        source):
    import jdp

    loader = make(source, rank=1)
    # independent: rank 1 of 2 reads the epoch's permutation at positions 1, 3, 5, ...
    order = np.random.default_rng(5).permutation(N)
    chosen = np.resize(order, 2 * 102)[1::2]
    chosen_real = np.arange(1, 2 * 102, 2) < N  # the last one repeats order[0]: padding
    mesh_devices = list(jdp.mesh().devices.flat)
    batches = list(loader)
    for b, batch in enumerate(batches):
        assert set(batch) == {"x", "id", "mask"}
        for key, shape in [("x", (BATCH, 3)), ("id", (BATCH,)), ("mask", (BATCH,))]:
            leaf = batch[key]
            assert isinstance(leaf, jax.Array) and leaf.shape == shape
            assert leaf.sharding.mesh == jdp.mesh()
            assert leaf.sharding.spec == jax.sharding.PartitionSpec(jdp.AXIS)
            by_row = sorted(leaf.addressable_shards, key=lambda s: s.index[0].start)
            assert [s.device for s in by_row] == mesh_devices
            assert [s.data.shape[0] for s in by_row] == [BATCH // 8] * 8
        want = chosen[b * BATCH:(b + 1) * BATCH]
        real = np.asarray(batch["mask"])
        np.testing.assert_array_equal(real[:len(want)], chosen_real[b * BATCH:(b + 1) * BATCH])
        assert not real[len(want):].any()
        np.testing.assert_array_equal(np.asarray(batch["id"])[:len(want)], want)
        np.testing.assert_array_equal(np.asarray(batch["x"])[:len(want)], source["x"][want])
    assert len(batches) == 4


def test_pmap_layout_leaves_are_stacked_over_the_8_devices_with_the_source_rows(source):
    loader = make(source, rank=1, layout="pmap")
    devices = jax.local_devices()
    assert len(devices) == 8
    for batch in loader:
        assert set(batch) == {"x", "id", "mask"}
        for key, shape in [("x", (8, 4, 3)), ("id", (8, 4)), ("mask", (8, 4))]:
            leaf = batch[key]
            assert isinstance(leaf, jax.Array) and leaf.shape == shape
            by_slice = sorted(leaf.addressable_shards, key=lambda s: s.index[0].start)
            assert [s.device for s in by_slice] == devices
            assert [s.data.shape[0] for s in by_slice] == [1] * 8
        assert batch["mask"].dtype == np.bool_
        rows = np.asarray(batch["id"]).reshape(-1)
        np.testing.assert_array_equal(np.asarray(batch["x"]).reshape(-1, 3), source["x"][rows])


def test_batches_follow_the_samplers_order_and_pad_the_last_batch(source):
    loader = make(source, rank=1, shuffle=False)
    batches = list(loader)
    # rank 1 without shuffle: 1, 3, ..., 201, then padding index 0 (masked); 102 slots
    expected = list(range(1, N, 2))
    assert [i for b in ids(batches) for i in b] == expected
    last = batches[-1]
    assert np.asarray(last["mask"]).reshape(-1).tolist() == [True] * 5 + [False] * 27
    assert np.asarray(last["id"]).reshape(-1)[:6].tolist() == [193, 195, 197, 199, 201, 0]


def test_drop_last_drops_the_partial_batch(source):
    loader = make(source, rank=0, drop_last=True)
    batches = list(loader)
    assert len(loader) == len(batches) == 3  # 102 // 32
    assert all(np.asarray(b["mask"]).all() for b in batches)


def test_default_sampler_covers_the_whole_source_on_one_process(source):
    loader = Loader(source, 64, shuffle=True, seed=1)
    assert sorted(i for b in ids(loader) for i in b) == list(range(N))


def test_position_counts_batches_handed_out_and_advances_after_the_epoch(source):
    loader = make(source)
    assert (loader.epoch, loader.step) == (0, 0)
    for k, _ in enumerate(loader):
        assert loader.step == k + 1
        time.sleep(0.01)  # let the prefetcher run ahead: it must not count
        assert loader.step == k + 1
    assert (loader.epoch, loader.step) == (1, 0)
    assert loader.sampler.epoch == 1


def test_a_loop_left_at_the_last_batch_saves_the_start_of_the_next_epoch(source):
    """Leaving at an epoch's last batch (a preemption there) keeps the position in memory, but
    saves it as the next epoch's start: a resumed range(loader.epoch, ...) loop goes on there."""
    reference = make(source, rank=1)
    reference.set_epoch(3)
    expected = ids(reference)
    first = make(source, rank=1)
    first.set_epoch(2)
    for _ in first:
        if first.step == len(first):
            break
    assert (first.epoch, first.step) == (2, len(first))
    saved = json.loads(json.dumps(first.state_dict()))
    assert (saved["epoch"], saved["step"], saved["offset"]) == (3, 0, 0)
    resumed = make(source, rank=1)
    resumed.load_state_dict(saved)
    assert resumed.epoch == 3 and ids(resumed) == expected


def test_restart_from_state_dict_yields_the_remaining_batches(source):
    reference = make(source, rank=1)
    reference.set_epoch(2)
    expected = ids(reference)

    first = make(source, rank=1)
    first.set_epoch(2)
    taken = []
    for batch in first:
        taken += ids([batch])
        if first.step == 2:
            break
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["epoch"] == 2 and saved["step"] == 2

    resumed = make(source, rank=1)
    resumed.load_state_dict(saved)
    assert taken + ids(resumed) == expected
    assert (resumed.epoch, resumed.step) == (3, 0)


def run_design_loop(loader, num_epochs, log, stop_at=None):
    """The DESIGN resumable loop; returns True when it stopped at `stop_at` (epoch, step)."""
    for epoch in range(loader.epoch, num_epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            log.append((epoch, ids([batch])[0]))
            if (loader.epoch, loader.step) == stop_at:
                return True
    return False


@pytest.mark.parametrize("stop_at", [(1, 2), (0, 4), (2, 1)])
def test_the_design_resumable_loop_continues_exactly_where_it_stopped(source, stop_at):
    expected = []
    run_design_loop(make(source), 3, expected)
    assert len(expected) == 3 * 4

    log = []
    crashed = make(source)
    assert run_design_loop(crashed, 3, log, stop_at=stop_at)
    saved = json.loads(json.dumps(crashed.state_dict()))
    resumed = make(source)
    resumed.load_state_dict(saved)
    run_design_loop(resumed, 3, log)
    assert log == expected


def test_set_epoch_inside_the_current_epoch_is_a_no_op(source):
    loader = make(source)
    loader.set_epoch(0)
    for _ in loader:
        if loader.step == 2:
            break
    loader.set_epoch(0)
    assert (loader.epoch, loader.step) == (0, 2)
    assert len(list(loader)) == 2
    loader.set_epoch(4)
    assert (loader.epoch, loader.step) == (4, 0)


def test_calling_the_samplers_set_epoch_directly_moves_the_loader(source):
    loader = make(source)
    next(iter(loader))
    loader.sampler.set_epoch(3)  # the torch habit
    assert (loader.epoch, loader.step) == (3, 0)
    expected = make(source)
    expected.set_epoch(3)
    assert ids(loader) == ids(expected)


def test_prefetch_zero_gives_the_same_batches(source):
    assert ids(make(source, prefetch=0)) == ids(make(source, prefetch=3))


def test_breaking_early_stops_the_prefetch_thread(source):
    loader = make(source, prefetch=1)
    for _ in loader:
        assert prefetch_threads()
        break
    assert wait_no_prefetch_threads() == []


def test_dropping_the_loader_mid_epoch_stops_the_prefetch_thread(source):
    loader = make(source, prefetch=1)
    it = iter(loader)
    next(it)
    assert prefetch_threads()
    del loader, it
    gc.collect()
    assert wait_no_prefetch_threads() == []


def test_an_exception_in_transform_reaches_the_consumer(source):
    def transform(batch):
        if batch["id"][0] == 64:
            raise ZeroDivisionError("bad batch")
        return batch

    loader = make(source, shuffle=False, transform=transform)  # rank 0: batch 1 starts at 64
    with pytest.raises(ZeroDivisionError, match="bad batch"):
        for _ in loader:
            pass
    assert loader.step == 1
    assert wait_no_prefetch_threads() == []


def test_transform_runs_on_host_batches_including_padding_rows(source):
    shapes = []

    def transform(batch):
        shapes.append(batch["x"].shape)
        return {"x": np.rint(batch["x"] * 7).astype(np.int32), "id": batch["id"]}

    loader = make(source, transform=transform)
    for batch in loader:
        rows = np.asarray(batch["id"]).reshape(-1)
        np.testing.assert_array_equal(np.asarray(batch["x"]).reshape(-1, 3),
                                      np.arange(N * 3).reshape(N, 3)[rows])
        assert batch["x"].dtype == np.int32
    assert shapes == [(BATCH, 3)] * 4


class ExampleSource:
    """A random-access source of dict examples, like tfds.data_source; counts its calls."""

    def __init__(self, arrays, batched):
        self.arrays, self.calls = arrays, {"getitem": 0, "getitems": 0}
        if batched:
            self.__getitems__ = self._getitems

    def __len__(self):
        return len(self.arrays["id"])

    def __getitem__(self, i):
        self.calls["getitem"] += 1
        return {k: v[i] for k, v in self.arrays.items()}

    def _getitems(self, keys):
        self.calls["getitems"] += 1
        return [{k: v[i] for k, v in self.arrays.items()} for i in keys]


@pytest.mark.parametrize("batched", [True, False])
def test_example_sources_give_the_same_batches_read_a_batch_at_a_time(source, batched):
    examples = ExampleSource(source, batched)
    loader = make(examples, prefetch=0)
    got = list(loader)
    reference = list(make(source))
    for a, b in zip(got, reference, strict=True):
        for key in ("x", "id", "mask"):
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))
    if batched:
        assert examples.calls == {"getitem": 0, "getitems": 4}
    else:
        assert examples.calls == {"getitem": 4 * BATCH, "getitems": 0}


def test_a_stuck_source_raises_timeout_instead_of_hanging(source):
    class Slow(ExampleSource):
        def _getitems(self, keys):
            time.sleep(0.5)
            return super()._getitems(keys)

    loader = make(Slow(source, batched=True), timeout=0.1)
    with pytest.raises(TimeoutError, match="timeout=0.1"):
        next(iter(loader))
    assert wait_no_prefetch_threads() == []


def test_fields_of_different_lengths_are_rejected_naming_them():
    one_line_error(ValueError, ["'x': 10", "'y': 9"], Loader,
                   {"x": np.zeros((10, 2)), "y": np.zeros(9)}, 8)


def test_batch_size_must_be_positive_and_divisible_by_the_local_devices(source):
    one_line_error(ValueError, ["batch_size=100", "8 local devices", "multiple of 8", "96"],
                   make, source, batch=100)
    one_line_error(ValueError, ["batch_size=0"], make, source, batch=0)
    one_line_error(ValueError, ["batch_size=-8"], make, source, batch=-8)
    one_line_error(TypeError, ["batch_size=32.0"], make, source, batch=32.0)


def test_other_bad_arguments_are_rejected(source):
    one_line_error(ValueError, ["num_examples=10", "203"], Loader, source, 8,
                   sampler=DistributedSampler(10))
    one_line_error(ValueError, ["'mask'"], Loader, {"mask": np.zeros(4)}, 8)
    one_line_error(ValueError, ["drop_last=True", "batch_size=256"], make, source, batch=256,
                   drop_last=True)
    one_line_error(TypeError, ["list_iterator"], Loader, iter([1, 2, 3]), 8)
    one_line_error(TypeError, ["str"], Loader, source, 8, sampler="all")
    one_line_error(ValueError, ["DistributedSampler"], Loader, source, 8,
                   sampler=DistributedSampler(N), shuffle=True)


def test_bad_examples_and_transforms_fail_in_the_consumer_with_clear_errors(source):
    class Tuples:
        def __len__(self):
            return N

        def __getitem__(self, i):
            return (i, i)

    one_line_error(TypeError, ["source[0]", "tuple", "dict"], next,
                   iter(make(Tuples(), shuffle=False)))
    shrink = make(source, transform=lambda b: {k: v[:8] for k, v in b.items()})
    one_line_error(ValueError, ["(8,", "batch_size=32"], next, iter(shrink))


def test_load_state_dict_rejects_a_position_from_another_configuration(source):
    saved = make(source, batch=64).state_dict()
    del saved["offset"]  # a position saved before offsets existed: only restores on its split
    one_line_error(ValueError, ["batch_size", "64", "32"], make(source).load_state_dict, saved)
    saved = make(source, batch=64).state_dict()
    one_line_error(ValueError, ["num_examples", "203", "204"],
                   Loader({"x": np.zeros(204)}, 32).load_state_dict, saved)
    saved = make(source, seed=1).state_dict()
    one_line_error(ValueError, ["seed"], make(source).load_state_dict, saved)
    saved = dict(make(source).state_dict(), step=9)
    one_line_error(ValueError, ["step=9"], make(source).load_state_dict, saved)


def test_array_source_counts_examples_and_reads_like_the_dict(source):
    from jdp.data import ArraySource

    wrapped = ArraySource(source)
    assert len(wrapped) == N and wrapped[5]["id"] == 5
    assert [e["id"] for e in wrapped.__getitems__([3, 1])] == [3, 1]
    assert ids(make(wrapped)) == ids(make(source))


def test_global_layout_is_the_pmap_batch_flattened_into_one_array_sharded_over_the_mesh(source):
    from jdp.core import batch_sharded

    stacked = list(make(source, rank=1, layout="pmap"))
    flat = list(make(source, rank=1))
    assert len(flat) == len(stacked) == 4
    for g, p in zip(flat, stacked, strict=True):
        assert set(g) == {"x", "id", "mask"}
        for key in g:
            assert isinstance(g[key], jax.Array) and g[key].shape[0] == BATCH
            assert g[key].sharding == batch_sharded()
            want = np.asarray(p[key]).reshape(BATCH, *p[key].shape[2:])
            np.testing.assert_array_equal(np.asarray(g[key]), want)
        # row j lives on device j // 4 of the mesh, as in the pmap layout
        for shard in g["id"].addressable_shards:
            device_slot = jax.local_devices().index(shard.device)
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(p["id"])[device_slot])


def test_layout_is_checked_and_devices_only_go_with_pmap(source):
    one_line_error(ValueError, ["layout='stacked'", "'global'"], make, source, layout="stacked")
    one_line_error(ValueError, ["devices=", "layout='global'"], make, source, layout="global",
                   devices=jax.local_devices())
    one_line_error(ValueError, ["devices=", "layout='pmap'"], make, source,
                   devices=jax.local_devices())  # the default layout is global
    reverse = jax.local_devices()[::-1]
    batch = next(iter(make(source, layout="pmap", devices=reverse)))
    by_slice = sorted(batch["id"].addressable_shards, key=lambda s: s.index[0].start)
    assert [s.device for s in by_slice] == reverse
