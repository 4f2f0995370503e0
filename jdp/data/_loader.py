"""`Loader`: this process's examples as global batches on `jdp.mesh()`, resumable anywhere.

The Loader reads the examples its `DistributedSampler` chooses (here or in worker processes),
puts each batch on the devices ahead of use, and keeps its position (`epoch`, `step`, the
global `offset` into the epoch) resumable through `state_dict()`, also on another world size::

    source = jdp.data.ArraySource({"image": images, "label": labels})
    sampler = jdp.data.DistributedSampler(len(source), shuffle=True, seed=0)
    loader = jdp.data.Loader(source, batch_size=256, sampler=sampler)
    for epoch in range(loader.epoch, num_epochs):   # after ckpt.restore(state, loader=loader)
        loader.set_epoch(epoch)                     # no-op inside the current epoch
        for batch in loader:                        # the rest of the current epoch
            state, metrics = step(state, batch)

`batch["mask"]` is False for the sampler's padding (repeats that give every process as many
examples) and for the rows filling an epoch's last partial batch, so every example counts
exactly once per epoch and evaluation over a split is exact (`jdp.eval_step` weights by it).
"""
from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jdp.core import StepWindow, batch_sharded, layouts
from jdp.data import _background, _sampler, _sources
from jdp.data._sampler import DistributedSampler, _require_int
from jdp.distributed import AGREE_TIMEOUT_S, agree, agree_once, require_job
from jdp.job import rank as _rank
from jdp.job import values
from jdp.job.env import MAX_SECONDS


class Loader:
    """Global batches of this process's examples, prefetched onto the devices.

    Iterating yields the rest of the current epoch (`loader.epoch`) as dicts: the source's
    fields, each one global `jax.Array` `[batch_size * jax.process_count(), ...]` sharded along
    `jdp.AXIS` over `jdp.mesh()` (this process's rows on its own devices: what `jdp.train_step`
    takes), plus `batch["mask"]`, bool `[global_batch]`: True for real examples, False for
    padding. After the last batch `epoch` advances by one and `step` returns to 0; stopping
    early keeps the position, so the next iteration continues there.

    A peek loses nothing, as with torch (whose `iter(DataLoader)` starts afresh): the batch of
    `next(iter(loader))` goes back, as does that of an iterator kept from `iter(loader)` (`it
    = iter(loader); next(it)`) that is superseded by a later `iter(loader)` after one batch;
    so the next loop starts with it. A loop of jdp steps (`jdp.train_step`, `jdp.eval_step`
    ran after every earlier batch) left early gives back its last batch if no step ran on it.
    Anything else handed out counts as used: a step of your own (a `jax.jit` function) cannot
    be seen. Leaving after a single batch that no jdp step ran on, other than by a peek as
    above, keeps that batch used, and the next loop, starting after it, says so (a warning,
    once per Loader).

    `batch_size` is per process: the examples this process feeds its local devices, split
    evenly over them. The epoch's last partial batch is padded up to `batch_size` (its padding
    rows masked out) unless `drop_last=True` drops it.

    Args:
        source: an `ArraySource` or a dict of arrays with one row per example (read by numpy
            fancy indexing), or an object with `__len__` and `__getitem__` returning dicts of
            fields (`tfds.data_source(...)`, grain sources; `__getitems__` used when present).
        batch_size: examples per batch on this process, a multiple of the local device count.
        sampler: a `DistributedSampler` over `len(source)` examples; default: one over all
            processes with the `shuffle` and `seed` given here.
        shuffle: for the default sampler only.
        seed: for the default sampler only.
        transform: `transform(batch) -> batch` on host numpy arrays `[batch_size, ...]` (e.g.
            normalise, cast); it sees padding rows too and must keep the leading axis. For
            random augmentation declare a parameter named `rng`: `transform(batch, rng)` gets
            `rng`, a list of `batch_size` numpy Generators, row j's seeded by `(sampler.seed,
            epoch, index of row j's example)`; draw row j's randomness from `rng[j]` only, and
            an example's augmentation replays on any worker or process count and resume point.
        drop_last: drop the last partial batch of each epoch instead of padding it.
        prefetch: batches prepared and put on the devices ahead by a background thread; 0:
            none ahead (each batch is read when asked for, still in that thread so that
            `timeout` holds; with `timeout=None`, in the consuming thread).
        devices: with `layout="pmap"` only: the devices to split over; default
            `jax.local_devices()` (pmap's order).
        timeout: seconds to wait for one batch before raising TimeoutError; None waits forever.
        layout: "global" (default) as above; "pmap", the classic pmap form: leaves
            `[local_devices, batch_size // local_devices, ...]`, slice i on device i (what
            `jdp.pmap.train_step` takes), `batch["mask"]` `[local_devices, per_device]`.
        num_workers: worker processes that read and transform (0: the prefetch thread does).
            The batches are those of `num_workers=0`, in the same order. Workers are started
            at the first iteration (by a 'forkserver', never forked from this process) and
            kept until `close()`, garbage collection or exit; the source and transform must be
            picklable (module-level functions and classes), and a script must start under
            `if __name__ == "__main__":`.

    Example:
        >>> import numpy as np
        >>> loader = Loader({"x": np.zeros((100, 3)), "y": np.arange(100)}, batch_size=16)
        >>> batch = next(iter(loader))   # a peek: the batch goes back
        >>> batch["x"].shape, len(loader), loader.step   # 7 batches (the last padded)
        ((16, 3), 7, 0)
    """

    def __init__(self, source: Any, batch_size: int, sampler: DistributedSampler | None = None,
                 *, shuffle: bool | None = None, seed: int | None = None,
                 transform: Callable[..., dict] | None = None, drop_last: bool = False,
                 prefetch: int = 2, devices: Sequence[jax.Device] | None = None,
                 timeout: float | None = 300.0, layout: str = "global", num_workers: int = 0):
        require_job("jdp.data.Loader")
        num_examples, read = _sources.make_reader(source)
        self.sampler = _default_sampler(sampler, num_examples, shuffle, seed)
        self._place = _placement(layout, devices)  # the one place the layout is looked at
        self.layout = layout
        self.devices = list(jax.local_devices() if devices is None else devices)
        self.batch_size = _require_int("Loader", "batch_size", batch_size, 1,
                                       "pass the number of examples per batch on this process")
        self.drop_last = values.flag("Loader", "drop_last", drop_last)
        self.transform = transform
        self.prefetch = _require_int("Loader", "prefetch", prefetch, 0,
                                     "pass the number of batches to prepare ahead (0: none)")
        self.num_workers = _require_int("Loader", "num_workers", num_workers, 0,
                                        "pass the number of worker processes (0: read here)")
        self.timeout = None if timeout is None else values.seconds(
            "Loader", "timeout", timeout, maximum=MAX_SECONDS, fix="or None: no limit")
        _check_args(self, num_examples)
        self._recipe = _sources.Recipe(read, transform, _sources.wants_rng(transform))
        if self.num_workers:
            _background.check_picklable(self._recipe, self.num_workers)
        self._epoch, self._start, self._step = self.sampler.epoch, 0, 0
        self._active: weakref.ref | None = None
        self._run: _Pass | None = None   # the active iterator's record (what it handed out)
        self._left_one: tuple | None = None   # (epoch, step) after a pass left after one batch
        self._said_left_one = False
        self._signatures: set = set()   # batch signatures the processes agreed on
        self._pool: _background.Pool | None = None
        self._stop_pool: weakref.finalize | None = None
        self._window = StepWindow()   # the user's own step: seen and bounded

    def __len__(self) -> int:
        """Batches per epoch on this process (fewer in an epoch resumed on another world size)."""
        return self._num_batches(0)

    def _num_batches(self, start: int) -> int:
        per_rank = self.sampler.pass_length(start)
        return per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)

    @property
    def epoch(self) -> int:
        """The current epoch (the one that iterating yields)."""
        self._follow_sampler()
        return self._epoch

    @property
    def step(self) -> int:
        """Batches of the current epoch handed out so far (prefetched ones do not count)."""
        self._follow_sampler()
        return self._step

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of epoch `epoch`; a no-op when already in it (resumes mid-epoch).

        Calling the sampler's `set_epoch` directly has the same effect between epochs; inside
        a loop over the epoch it raises RuntimeError at the next batch.
        """
        epoch = _require_int("Loader.set_epoch", "epoch", epoch, 0,
                             "pass the epoch number, counted from 0")
        if epoch != self.epoch:
            self._move(epoch, 0)

    def __iter__(self) -> Iterator[dict]:
        self._follow_sampler()
        self._end_active()
        self._after_one_batch()
        run = _Pass(sys._getframe(1))
        batches = self._iterate(run)
        self._active, self._run = weakref.ref(batches), run
        return batches

    def _end_active(self) -> None:
        """Before a new pass: a `for` loop still running over the Loader is refused (nested
        loops would share its position); an iterator made by `iter(loader)` is superseded
        (what it handed out and no step used goes back; using it again raises)."""
        active = self._active() if self._active else None
        if active is None or inspect.getgeneratorstate(active) not in (
                inspect.GEN_SUSPENDED, inspect.GEN_RUNNING):
            self._close_active()
            return
        run = self._run
        if run is None or not run.explicit:
            raise RuntimeError(f"Loader: iter(loader) while an earlier iterator over it is still "
                               f"active at (epoch, step)={(self._epoch, self._step)}: nested "
                               "loops over one Loader would share its position; finish, break "
                               "out of or close() the first loop, or build a second Loader for "
                               "the inner one")
        run.superseded = True
        self._abandoned(run)
        self._active = self._run = None
        if run.batches is not None:
            run.batches.close()   # its prefetch thread stops; the generator raises if used

    def _iterate(self, run: _Pass) -> Iterator[dict]:
        self._agree()
        indices, real = self.sampler.pass_rows(self._start)
        plan = _sources.EpochPlan(indices, real, self.batch_size, self.sampler.seed, self._epoch)
        items = range(self._step, self._num_batches(self._start))
        host, place = self._host_batches(plan, items), self._place
        batches = run.batches = _background.prefetched(lambda b: place(host(b)), items,
                                                       self.prefetch, self.timeout)
        with contextlib.closing(batches), self._workers_broken_on_timeout():
            while True:
                _rank.record("data")  # waiting for a batch: a rank stuck reading shows "data"
                batch = next(batches, None)
                if batch is None:
                    break
                agree_once(self._signatures, "loader-batch", batch, "jdp.data.Loader",
                                   "every process's source and transform must give fields of "
                                   "the same dtypes and shapes",
                                   self.timeout or AGREE_TIMEOUT_S)
                self._inside_epoch()
                self._step += 1
                run.hand_out()
                self._window.handed(batch, count=True)
                try:
                    yield batch
                except GeneratorExit:   # closed or collected mid-epoch, here:
                    if self._run is run:
                        self._abandoned(run, _closer())
                    raise
                if run.superseded:
                    raise RuntimeError(f"Loader: this iterator was superseded by a later "
                                       f"iter(loader), which continues from (epoch, step)="
                                       f"{(self._epoch, self._step)}; a Loader has one position, "
                                       "so use the newest iterator only, or build a second "
                                       "Loader for a second stream of batches")
        self._active = self._run = None  # finished: _move must not close this running generator
        self._move(self._epoch + 1, 0)

    def _abandoned(self, run: _Pass, dropped: tuple | None = None) -> None:
        """An iterator left mid-epoch (dropped or closed at `dropped`): its batch that no step
        used goes back (`_Pass.unused`). One left after its only batch otherwise is noted:
        the next pass that starts after it says so (it may have been meant as a peek)."""
        back = run.unused(dropped)
        self._step -= back
        if not back and run.one_unstepped():
            self._left_one = (self._epoch, self._step)

    def _after_one_batch(self) -> None:
        """Once per Loader, a pass starting right after one left after its only batch, which
        no jdp step ran on, says that batch was used up (torch would start afresh)."""
        if self._said_left_one or self._left_one != (self._epoch, self._step):
            return
        self._said_left_one = True
        warnings.warn(f"jdp.data.Loader: this loop starts at batch {self._step} of epoch "
                      f"{self._epoch}, after an iterator over the Loader that was left after "
                      "one batch with no jdp step run on it, so that batch counts as used "
                      "(torch's DataLoader starts every loop afresh); to look at a batch "
                      "without using it up take next(iter(loader)) in one statement, which "
                      "gives it back", stacklevel=3)

    def _agree(self) -> None:
        """At the start of every pass: every process has the same dataset size, batch size,
        sampler and position (else the global batches would mix or hang), and a process that
        skips the pass is named (an agreement point: `jdp.distributed.agree`)."""
        if not 1 < jax.process_count() == self.sampler.num_replicas:
            return
        facts = [(k, repr(v)) for k, v in self.state_dict().items()] + [("layout", self.layout)]
        agree("loader", facts, "jdp.data.Loader", "build the Loader with the same dataset "
              "(len(source)), batch_size and sampler settings, and restore the same "
              "position, on every process", self.timeout or AGREE_TIMEOUT_S)

    def _host_batches(self, plan: _sources.EpochPlan, items: range) -> Callable[[int], dict]:
        """`b -> host batch b`: built here, or asked of the worker processes."""
        if not self.num_workers:
            return functools.partial(_sources.host_batch, self._recipe, plan)
        ahead = 2 * self.num_workers
        if self._pool is not None and not self._pool.broken:
            try:
                return self._pool.start_pass(plan, items, ahead)
            except _background.Busy:   # still building an abandoned pass's batches
                pass
        self._stop_workers()
        self._pool = _background.Pool(self._recipe, self.num_workers)
        self._stop_pool = weakref.finalize(self, self._pool.close)
        return self._pool.start_pass(plan, items, ahead)

    @contextlib.contextmanager
    def _workers_broken_on_timeout(self) -> Iterator[None]:
        """A pass that timed out leaves a worker busy: the next pass starts fresh workers."""
        try:
            yield
        except TimeoutError:
            if self._pool is not None:
                self._pool.broken = True
            raise

    def close(self) -> None:
        """Stop the worker processes now (idempotent; the next iteration starts new ones); an
        iterator still open is left as a loop left early is (see the class: what goes back)."""
        self._close_active(abandon=True)
        self._stop_workers()

    def _stop_workers(self) -> None:
        if self._stop_pool is not None:
            self._stop_pool()
        self._pool = self._stop_pool = None

    def state_dict(self) -> dict:
        """The position and the configuration it depends on, JSON-serialisable.

        Returns:
            `{"epoch", "step", "start", "offset", "num_examples", "num_replicas", "shuffle",
            "seed", "sampler_drop_last", "batch_size", "drop_last"}`. `offset` counts the
            examples of the epoch consumed by all processes together; without the rank, process
            0's copy restores every process. An epoch whose last batch was taken is saved as the
            start of the next one, where a resumed `range(loader.epoch, num_epochs)` loop goes on.
        """
        s, epoch, step, start = self.sampler, self.epoch, self.step, self._start
        if step and step == self._num_batches(start):
            epoch, step, start = epoch + 1, 0, 0
        at = _sampler.offset(s, _sampler.Position(epoch, start, step), self.batch_size)
        return {"epoch": epoch, "step": step, "start": start, "offset": at,
                "num_examples": s.num_examples, "num_replicas": s.num_replicas,
                "shuffle": s.shuffle, "seed": s.seed, "sampler_drop_last": s.drop_last,
                "batch_size": self.batch_size, "drop_last": self.drop_last}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from a position saved by `state_dict()`.

        With the same number of processes and batch size the same remaining batches follow
        (bitwise). With another (an elastic restart), the epoch continues with exactly the
        examples no process had consumed, each once, split over the new processes as a fresh
        epoch would be (padding masked); the next epochs are whole as usual.

        Raises:
            ValueError: the saved dataset size, shuffle, seed or sampler drop_last differ from
                this loader's (the epoch's order would differ), or the position is outside it.
        """
        pos = _sampler.restored(state, self.state_dict(), self._num_batches)
        self._move(pos.epoch, pos.step, pos.start)

    def _move(self, epoch: int, step: int, start: int = 0) -> None:
        self._close_active()
        self.sampler.set_epoch(epoch)
        self._epoch, self._start, self._step = epoch, start, step

    def _inside_epoch(self) -> None:
        """sampler.set_epoch(e) inside an epoch would change the order under a running pass."""
        if self.sampler.epoch != self._epoch:
            epoch, self.sampler.epoch = self.sampler.epoch, self._epoch
            raise RuntimeError(f"Loader: sampler.set_epoch({epoch}) was called inside epoch "
                               f"{self._epoch} (after {self._step} of {len(self)} batches); call "
                               "set_epoch before iterating over the loader, or break out of "
                               "the loop first")

    def _follow_sampler(self) -> None:
        """Someone called sampler.set_epoch(e) directly: treat it as ours."""
        if self.sampler.epoch != self._epoch:
            self._move(self.sampler.epoch, 0)

    def _close_active(self, abandon: bool = False) -> None:
        """Close the active iterator; `abandon`: its unused batch goes back (`close()`), else
        the position is about to be set (`_move`)."""
        active = self._active() if self._active is not None else None
        run, self._active, self._run = self._run, None, None
        if abandon and run is not None and active is not None:
            self._abandoned(run)
        if active is not None:
            active.close()

    def __repr__(self) -> str:
        return (f"Loader(batch_size={self.batch_size}, layout={self.layout!r}, devices="
                f"{len(self.devices)}, num_workers={self.num_workers}, drop_last="
                f"{self.drop_last}, epoch={self._epoch}, step={self._step}, len={len(self)}, "
                f"sampler={self.sampler!r})")


def _statement(frame: Any) -> tuple:
    """The statement `frame` executes: its code, the frame and the line."""
    return frame.f_code, id(frame), frame.f_lineno


def _closer() -> tuple | None:
    """The statement that closed or dropped the generator calling this (None: none, as at
    interpreter exit)."""
    try:
        return _statement(sys._getframe(2))
    except ValueError:
        return None


class _Pass:
    """One iteration over the Loader: where it was made, what it handed out and which of it a
    jdp step used, so that an iterator left mid-epoch gives back the batch no step used.

    jdp's steps count their calls (`in_flight.jdp_calls`, as `jdp.core.StepWindow` reads
    them): a call between two hand-outs means a step ran on the earlier batch. A user's own
    `jax.jit` step leaves no trace, so without jdp steps only a peek gives its batch back.
    """

    def __init__(self, caller: Any):
        self.made = _statement(caller)    # the statement that called iter(loader)
        self.explicit = not _for_statement(caller)
        self.handed = 0                   # batches handed out
        self.stepped = True               # a jdp step ran between every two hand-outs
        self.calls = 0                    # jdp_calls at the last hand-out
        self.superseded = False           # a later iter(loader) took over
        self.batches: Any = None          # the prefetcher, stopped when superseded

    def hand_out(self) -> None:
        calls = _rank.current().in_flight.jdp_calls
        if self.handed and calls == self.calls:
            self.stepped = False
        self.handed, self.calls = self.handed + 1, calls

    def _last_unstepped(self) -> bool:
        return self.handed > 0 and _rank.current().in_flight.jdp_calls == self.calls

    def one_unstepped(self) -> bool:
        """One batch handed out and no jdp step after it."""
        return self.handed == 1 and self._last_unstepped()

    def unused(self, dropped: tuple | None) -> int:
        """Batches to give back (0 or 1): the last one if no jdp step ran after it, in a loop
        of jdp steps (one ran after every earlier batch), or in a peek: an iterator made by
        `iter(loader)` that handed out one batch and was dropped in the statement that made
        it (`next(iter(loader))`) or superseded by a later `iter(loader)`."""
        if self.handed > 1:
            return int(self.stepped and self._last_unstepped())
        peek = self.explicit and (self.superseded or dropped == self.made)
        return int(peek and self.one_unstepped())


_GET_ITER = dis.opmap.get("GET_ITER")


def _for_statement(frame: Any) -> bool:
    """Whether the frame calling `iter(loader)` runs a `for` statement or comprehension over
    it (its current instruction is GET_ITER) rather than calling `iter()` itself (directly,
    or through next, enumerate, zip); when unknown, a for statement (nothing goes back)."""
    try:
        return frame.f_code.co_code[frame.f_lasti] == _GET_ITER
    except (AttributeError, IndexError, TypeError):
        return True


def _placement(layout: Any, devices: Sequence[jax.Device] | None) -> Callable[[dict], dict]:
    """How a host batch goes on the devices: global arrays on `jdp.mesh()`, or the pmap form."""
    if not isinstance(layout, str) or layout not in layouts.names():
        raise ValueError(f"Loader: layout={layout!r}; expected one of {layouts.names()} "
                         "('global': [global_batch, ...] arrays, 'pmap': [local_devices, "
                         "per_device, ...])")
    if layout != layouts.GLOBAL:
        return functools.partial(layouts.named(layout).place_rows, devices=devices)
    if devices is not None:
        raise ValueError("Loader: devices= was given with layout='global', whose batches are "
                         "split over jdp.mesh(); drop devices=, or pass layout='pmap' as well")
    return _global_batch


def _global_batch(host: dict) -> dict:
    """This process's rows as its part of global arrays split along `jdp.AXIS` (no host copy)."""
    sharding = batch_sharded()
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), host)


def _default_sampler(sampler: DistributedSampler | None, num_examples: int,
                     shuffle: bool | None, seed: int | None) -> DistributedSampler:
    """The sampler given (checked against the source), or one over all processes."""
    if sampler is None:
        shuffle = False if shuffle is None else values.flag("Loader", "shuffle", shuffle,
                                                            fix="or None (no shuffle)")
        return DistributedSampler(num_examples, shuffle=shuffle, seed=seed or 0)
    if not isinstance(sampler, DistributedSampler):
        raise TypeError(f"Loader: sampler is a {type(sampler).__name__}; expected a "
                        "jdp.data.DistributedSampler (the Loader needs its padding positions)")
    if shuffle is not None or seed is not None:
        raise ValueError("Loader: shuffle/seed are for the default sampler; with sampler= given "
                         "pass them to the DistributedSampler instead")
    if sampler.num_examples != num_examples:
        raise ValueError(f"Loader: the sampler covers num_examples={sampler.num_examples} but "
                         f"the source has {num_examples} examples; build it as "
                         f"DistributedSampler({num_examples}, ...)")
    return sampler


def _check_args(loader: Loader, num_examples: int) -> None:
    """Devices, batch size, transform and drop_last fit together."""
    n = len(loader.devices)
    if n == 0:
        raise ValueError("Loader: devices=[] is empty; pass None (all local devices) or a list")
    if loader.batch_size % n:
        fix = max(n, loader.batch_size // n * n)
        raise ValueError(f"Loader: batch_size={loader.batch_size} is not divisible by the {n} "
                         f"local devices; batch_size is per process and split evenly over them: "
                         f"use a multiple of {n} (e.g. {fix})")
    if loader.transform is not None and not callable(loader.transform):
        raise TypeError(f"Loader: transform={loader.transform!r} is not callable; pass "
                        "transform(batch) -> batch (or transform(batch, rng)) or None")
    if loader.drop_last and len(loader) == 0:
        raise ValueError(f"Loader: drop_last=True with batch_size={loader.batch_size} leaves no "
                         f"batch of the {len(loader.sampler)} examples this process gets (of "
                         f"{num_examples}); use a smaller batch_size or drop_last=False")
