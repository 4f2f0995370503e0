"""Data misuse catalogue: each mistake is a one-line error of the right type naming the value.

Issue 17's data cases first (nested loops, swallowed __getitems__ errors, string fields,
unnamed failing examples), then the argument mistakes a new user makes.
"""
import os
import threading
import time

import numpy as np
import pytest
from conftest import one_line_error as refused

from jdp.data import DistributedSampler, Loader

# private: the internals this test checks have no public name
from jdp.data._background import WorkerTraceback

N = 40


def source():
    return {"x": np.arange(N * 2, dtype=np.float32).reshape(N, 2), "id": np.arange(N)}


class Examples:
    """A random-access source; `fail` maps an index to the exception its read raises."""

    def __init__(self, fail=None, batched_error=None, field=lambda i: np.float32(i)):
        self.fail, self.batched_error, self.field = fail or {}, batched_error, field
        self.single_reads = 0

    def __len__(self):
        return N

    def __getitem__(self, i):
        self.single_reads += 1
        if i in self.fail:
            raise self.fail[i]
        return {"x": self.field(i), "id": i}

    def __getitems__(self, keys):
        if self.batched_error is not None:
            raise self.batched_error
        return [self[i] for i in keys]


class OneAtATime(Examples):
    """The same source without a batched read."""
    __getitems__ = None


def first(loader):
    return next(iter(loader))


# --- issue 17 ---------------------------------------------------------------------------

def test_a_nested_loop_over_one_loader_is_refused_instead_of_ending_the_outer_loop():
    loader = Loader(source(), 8)

    def nested():
        for _ in loader:
            for _ in loader:
                pass

    refused(RuntimeError, ["nested loops", "(epoch, step)=(0, 1)", "second Loader"], nested)
    # breaking out and iterating again is no nesting: it continues where the loop stopped
    loader = Loader(source(), 8)
    for _ in loader:
        break
    with pytest.warns(UserWarning, match="starts at batch 1 of epoch 0"):   # no peek: it says
        assert loader.step == 1 and len(list(loader)) == len(loader) - 1


def test_a_type_error_inside_getitems_is_raised_not_swallowed():
    examples = Examples(batched_error=TypeError("codec missing"))
    error = refused(RuntimeError, ["__getitems__", "TypeError: codec missing", "[0, 1, 2"],
                    first, Loader(examples, 8, shuffle=False))
    assert isinstance(error.__cause__, TypeError)


def test_an_error_inside_getitem_names_the_example_index():
    fail = {13: OSError("disk block unreadable")}
    for examples in (Examples(fail), OneAtATime(fail)):
        loader = Loader(examples, 8, shuffle=False, prefetch=0)
        error = refused(RuntimeError, ["example index 13", "source[13]", "OSError",
                                       "disk block unreadable"], list, loader)
        assert isinstance(error.__cause__, OSError)


def test_a_string_field_is_named_before_it_reaches_jax():
    names = {"x": np.zeros(N, np.float32), "name": np.array([f"img{i}" for i in range(N)])}
    refused(TypeError, ["['name']", "<U5", "transform"], first, Loader(names, 8))
    objects = Examples(field=lambda i: {"nested": "text"})
    refused(TypeError, ["['x']", "object"], first, Loader(objects, 8))


# --- arguments --------------------------------------------------------------------------

@pytest.mark.parametrize("value, error", [(8.0, TypeError), (True, TypeError), ("8", TypeError),
                                          (0, ValueError), (-8, ValueError),
                                          (12, ValueError)])
def test_bad_batch_sizes(value, error):
    refused(error, [f"batch_size={value!r}" if error is TypeError else f"batch_size={value}"],
            Loader, source(), value)


@pytest.mark.parametrize("value, error", [(-1, ValueError), (1.5, TypeError), (None, TypeError)])
def test_bad_num_workers(value, error):
    refused(error, [f"num_workers={value!r}"], Loader, source(), 8, num_workers=value)


def test_bad_prefetch_and_timeout():
    refused(ValueError, ["prefetch=-1"], Loader, source(), 8, prefetch=-1)
    refused(ValueError, ["timeout=0"], Loader, source(), 8, timeout=0)
    refused(TypeError, ["timeout='5'"], Loader, source(), 8, timeout="5")
    refused(ValueError, ["timeout=inf"], Loader, source(), 8, timeout=float("inf"))


def test_bad_layouts():
    refused(ValueError, ["layout='gspmd'", "'pmap'", "'global'"], Loader, source(), 8,
            layout="gspmd")
    refused(ValueError, ["devices=", "layout='global'"], Loader, source(), 8, layout="global",
            devices=[])


def test_samplers_that_do_not_fit():
    refused(TypeError, ["range", "DistributedSampler"], Loader, source(), 8, sampler=range(N))
    refused(ValueError, ["num_examples=50", "40"], Loader, source(), 8,
            sampler=DistributedSampler(50, num_replicas=1, rank=0))
    refused(ValueError, ["shuffle/seed", "DistributedSampler"], Loader, source(), 8,
            sampler=DistributedSampler(N, num_replicas=1, rank=0), seed=3)
    refused(ValueError, ["rank=2", "num_replicas=2"], DistributedSampler, N, num_replicas=2,
            rank=2)
    refused(ValueError, ["num_examples=0"], DistributedSampler, 0, num_replicas=1, rank=0)


def test_transforms_that_return_the_wrong_thing():
    refused(TypeError, ["transform='normalize'", "callable"], Loader, source(), 8,
            transform="normalize")
    refused(TypeError, ["returned a tuple", "batch dict"], first,
            Loader(source(), 8, transform=lambda b: (b["x"], b["id"])))
    refused(ValueError, ["'mask'", "rename"], first,
            Loader(source(), 8, transform=lambda b: {**b, "mask": b["id"] > 3}))
    refused(ValueError, ["['x']", "1 row(s)", "(1, 2)", "batch_size=8 rows"], first,
            Loader(source(), 8, transform=lambda b: {**b, "x": b["x"][:1]}))


def test_a_lambda_transform_cannot_go_to_worker_processes():
    refused(TypeError, ["num_workers=2", "transform", "module level"], Loader, source(), 8,
            transform=lambda b: b, num_workers=2)


def test_sources_that_are_not_random_access_or_not_regular():
    refused(TypeError, ["generator", "__getitem__"], Loader, (x for x in range(3)), 8)
    refused(ValueError, ["'mask'"], Loader, {"mask": np.zeros(N)}, 8)
    ragged = Examples(field=lambda i: np.zeros(1 + i % 2, np.float32))
    refused(ValueError, ["field 'x'", "different shapes", "(1,)", "(2,)"], first,
            Loader(ragged, 8, shuffle=False))


def test_positions_that_are_not_positions():
    loader = Loader(source(), 8)
    refused(ValueError, ["epoch=-1"], loader.set_epoch, -1)
    refused(TypeError, ["epoch=1.5"], loader.set_epoch, 1.5)
    refused(TypeError, ["epoch=None", "state_dict"], loader.load_state_dict, {"step": 1})
    refused(ValueError, ["drop_last=True", "batch_size=48"], Loader, source(), 48,
            drop_last=True)


# --- issue 26: every wait has its timeout; the same error shuffled or not ---------------------

RELEASE = threading.Event()  # set at the end of a test: a stuck read in this process returns


class Stuck:
    """A source whose reads never return (in a worker: until it is killed)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        RELEASE.wait(30)
        return {"x": np.float32(i)}


@pytest.fixture
def release():
    RELEASE.clear()
    yield
    RELEASE.set()


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_stuck_source_times_out_in_every_configuration(release, num_workers, prefetch):
    loader = Loader(Stuck(), 8, prefetch=prefetch, num_workers=num_workers, timeout=1)
    start = time.monotonic()
    refused(TimeoutError, ["no batch arrived within timeout=1 s"], first, loader)
    assert time.monotonic() - start < 10
    loader.close()


class StuckWhile:
    """A source whose reads wait (up to 30 s) while the file `flag` exists, in any process."""

    def __init__(self, flag):
        self.flag = str(flag)

    def __len__(self):
        return N

    def __getitem__(self, i):
        deadline = time.monotonic() + 30
        while os.path.exists(self.flag) and time.monotonic() < deadline:
            time.sleep(0.02)
        return {"x": np.float32(i)}


def test_after_a_timeout_the_workers_are_replaced_and_the_next_pass_reads(tmp_path):
    flag = tmp_path / "stuck"
    loader = Loader(StuckWhile(flag), 8, num_workers=2, prefetch=0, timeout=2)
    first(loader)
    pids = loader._pool.pids()
    flag.touch()
    try:
        refused(TimeoutError, ["timeout=2 s"], first, loader)
    finally:
        flag.unlink()
    # each peek gives its batch back: the fresh workers read batch 0 again
    assert float(np.asarray(first(loader)["x"]).sum()) == sum(range(8))
    assert set(loader._pool.pids()).isdisjoint(pids)   # the busy workers were replaced
    loader.close()


class StuckBeyond(StuckWhile):
    """Examples past the first batch wait (up to 30 s each) while the file `flag` exists."""

    def __getitem__(self, i):
        return {"x": np.float32(i)} if i < 8 else super().__getitem__(i)


def test_a_pass_left_early_whose_batches_are_stuck_does_not_hold_up_the_next(tmp_path):
    """The workers still build batches 1-4, which a pass left after batch 0 asked ahead, and
    they are stuck: the next pass drops them with their workers within seconds (it used to wait
    for them, up to 30 s an example, before reading its own first batch; no timeout= set)."""
    flag = tmp_path / "stuck"
    flag.touch()
    loader = Loader(StuckBeyond(flag), 8, num_workers=2, prefetch=0)
    try:
        assert float(np.asarray(first(loader)["x"]).sum()) == sum(range(8))
        pids = loader._pool.pids()
        start = time.monotonic()
        assert float(np.asarray(first(loader)["x"]).sum()) == sum(range(8))
        assert time.monotonic() - start < 15
        assert set(loader._pool.pids()).isdisjoint(pids)
    finally:
        flag.unlink()
        loader.close()


class Keys(Examples):
    """Example 5 has field 'y' where the others have 'x'."""

    def __getitem__(self, i):
        return {"y": np.float32(i)} if i == 5 else {"x": np.float32(i)}


@pytest.mark.parametrize("shuffle", [False, True])
def test_examples_with_different_fields_name_the_odd_index_shuffled_or_not(shuffle):
    def epoch():
        for _ in Loader(Keys(), 8, shuffle=shuffle, prefetch=0):
            pass
    error = refused(ValueError, ["example(s) [5] have ['y'], but example(s) [",
                                 "have ['x']; every example must have the same fields"], epoch)
    assert "KeyError" not in str(error)


def test_sampler_set_epoch_inside_an_epoch_is_refused_not_ignored():
    loader = Loader(source(), 8)
    batches = iter(loader)
    next(batches)
    loader.sampler.set_epoch(3)
    refused(RuntimeError, ["sampler.set_epoch(3) was called inside epoch 0", "after 1 of 5",
                           "before iterating"], next, batches)
    assert (loader.epoch, loader.step, loader.sampler.epoch) == (0, 1, 0)
    loader.sampler.set_epoch(3)        # between epochs it moves the loader, as documented
    assert (loader.epoch, loader.step) == (3, 0)


def failing_transform(batch):
    if 13 in batch["id"]:
        raise ZeroDivisionError("bad pixel")
    return batch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_failing_transform_names_the_examples_and_keeps_its_traceback(num_workers):
    loader = Loader(source(), 8, transform=failing_transform, num_workers=num_workers)
    with pytest.raises(ZeroDivisionError, match="bad pixel") as info:
        for _ in loader:
            pass
    loader.close()
    assert "Loader: raised by transform on batch 1 of epoch 0 (example indices [8, 9, 10, " \
        "11, 12, 13, 14, 15])" in info.value.__notes__
    if num_workers:    # the worker's own traceback, down to the raising line, is the cause
        assert isinstance(info.value.__cause__, WorkerTraceback)
        assert 'raise ZeroDivisionError("bad pixel")' in str(info.value.__cause__)
        assert "in failing_transform" in str(info.value.__cause__)
