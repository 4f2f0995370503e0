"""Feeding data-parallel steps: `DistributedSampler` (torch semantics), `Loader`, `ArraySource`.

`DistributedSampler` splits the example indices of one epoch over the processes exactly as
`torch.utils.data.DistributedSampler` does. `Loader` reads this process's examples a batch at a
time (in this process, or in `num_workers` worker processes), splits each batch over the local
devices (`layout="pmap"`: `[local_devices, per_device, ...]`) or makes it this process's part of
one global array (`layout="global"`), adds `batch["mask"]` (False for padding) and puts
batches on the devices ahead of use in a background thread. `ArraySource` holds in-memory
examples as a dict of arrays (the fast path). The Loader's position (`epoch`, `step`, and the
global `offset` into the epoch) is resumable through `state_dict()`, also onto another number
of processes::

    source = jdp.data.ArraySource({"image": images, "label": labels})
    sampler = jdp.data.DistributedSampler(len(source), shuffle=True, seed=0)
    loader = jdp.data.Loader(source, batch_size=256, sampler=sampler)
    for epoch in range(loader.epoch, num_epochs):   # after ckpt.restore(state, loader=loader)
        loader.set_epoch(epoch)                     # no-op inside the current epoch
        for batch in loader:                        # the rest of the current epoch
            state, metrics = step(state, batch)

Padding: `batch["mask"]` is False for (1) the sampler's padding, which repeats indices from the
start of the epoch's list so that every process gets the same number of examples (torch's
padding), and (2) the rows that fill the last partial batch of an epoch up to `batch_size`.
With both masked out, every example of the source counts exactly once per epoch over all
processes, so evaluation over a whole split is exact (`jdp.eval_step` weights by the mask).

Augmentation that replays: a transform with a parameter named `rng` gets one
`numpy.random.Generator` per row, seeded by (sampler seed, epoch, example index), so an
example's augmentation does not depend on the worker count, the process count or where a run
resumed.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax

from jdp.data import _batches, _loader_checks, _position, _prefetch, _sources, _workers
from jdp.launch import _progress
from jdp.data._sampler import DistributedSampler, _require_int
from jdp.core import _mesh
from jdp.data._sources import ArraySource


class Loader:
    """Per-device batches of this process's examples, prefetched onto the local devices.

    Iterating yields the rest of the current epoch (`loader.epoch`) as dicts: the source's
    fields, each a `jax.Array` `[local_devices, batch_size // local_devices, ...]` sharded one
    slice per device in `jax.local_devices()` order (what a jdp step takes), plus
    `batch["mask"]`, bool `[local_devices, per_device]`: True for real examples, False for
    padding. After the last batch `epoch` advances by one and `step` returns to 0; stopping
    early keeps the position, so the next iteration continues there.

    `batch_size` is per process (like torch's DataLoader): what this process feeds its local
    devices, split evenly over them. The epoch's last partial batch is padded up to
    `batch_size` (its padding rows masked out) unless `drop_last=True` drops it. Examples are read
    a batch at a time (`source.__getitems__`, or numpy fancy indexing for a dict of arrays).

    Args:
        source: an `ArraySource` or a dict of arrays with one row per example (read by numpy
            fancy indexing), or an object with `__len__` and `__getitem__` returning dicts of
            fields (`tfds.data_source(...)`, grain sources; `__getitems__` used when present).
        batch_size: examples per batch on this process, a multiple of the local device count.
        sampler: a `DistributedSampler` over `len(source)` examples; default: one over all
            processes with the `shuffle` and `seed` given here.
        shuffle: for the default sampler only (as torch's DataLoader `shuffle`).
        seed: for the default sampler only.
        transform: `transform(batch) -> batch` on host numpy arrays `[batch_size, ...]` (e.g.
            normalise, cast); it sees padding rows too and must keep the leading axis. For
            random augmentation declare a parameter named `rng`: `transform(batch, rng)` gets
            `rng`, a list of `batch_size` numpy Generators, row j's seeded by `(sampler.seed,
            epoch, index of row j's example)`; draw row j's randomness from `rng[j]` only.
        drop_last: drop the last partial batch of each epoch instead of padding it.
        prefetch: batches prepared and put on the devices ahead by a background thread; 0 reads
            in the consuming thread.
        devices: the devices to split over; default `jax.local_devices()` (pmap's order).
            Only for `layout="pmap"`.
        timeout: seconds to wait for one batch before raising TimeoutError; None waits forever.
        layout: "pmap" (default): leaves `[local_devices, per_device, ...]` as above. "global":
            each leaf one global `jax.Array` `[batch_size * process_count, ...]` sharded along
            `jdp.AXIS` over `jdp.mesh()` (`NamedSharding(mesh, P(AXIS))`), this process's rows
            on its own devices, `batch["mask"]` `[global_batch]`: what a jit/shard_map step takes.
        num_workers: worker processes that read and transform (0: the prefetch thread does).
            The batches are those of `num_workers=0`, in the same order. Workers are started
            at the first iteration (by a 'forkserver', never forked from this process) and
            kept until `close()`, garbage collection or exit; the source and transform must be
            picklable (module-level functions and classes), and a script must start under
            `if __name__ == "__main__":`.

    Example:
        >>> loader = Loader({"x": np.zeros((100, 3)), "y": np.arange(100)}, batch_size=16)
        >>> batch = next(iter(loader))   # with 8 devices: batch["x"].shape == (8, 2, 3)
        >>> len(loader), loader.step      # 7 batches per epoch (the last one padded), 1 taken
        (7, 1)
    """

    def __init__(self, source: Any, batch_size: int, sampler: DistributedSampler | None = None,
                 *, shuffle: bool | None = None, seed: int | None = None,
                 transform: Callable[..., dict] | None = None, drop_last: bool = False,
                 prefetch: int = 2, devices: Sequence[jax.Device] | None = None,
                 timeout: float | None = 300.0, layout: str = "pmap", num_workers: int = 0):
        num_examples, read = _sources.make_reader(source)
        self.sampler = _loader_checks.default_sampler(sampler, num_examples, shuffle, seed)
        self.layout = _loader_checks.layout(layout, devices)
        self.devices = list(jax.local_devices() if devices is None else devices)
        self.batch_size = _require_int("Loader", "batch_size", batch_size, 1,
                                       "pass the number of examples per batch on this process")
        self.drop_last, self.transform = bool(drop_last), transform
        self.prefetch = _require_int("Loader", "prefetch", prefetch, 0,
                                     "pass the number of batches to prepare ahead (0: none)")
        self.num_workers = _require_int("Loader", "num_workers", num_workers, 0,
                                        "pass the number of worker processes (0: read here)")
        self.timeout = timeout
        _loader_checks.loader_args(self, num_examples)
        self._recipe = _batches.Recipe(read, transform, _batches.wants_rng(transform))
        if self.num_workers:
            _workers.check_picklable(self._recipe, self.num_workers)
        self._place = functools.partial(
            _mesh.place_batch, layout=self.layout,
            sharding=None if self.layout == _mesh.GLOBAL else _mesh.local_sharding(devices))
        self._epoch, self._start, self._step = self.sampler.epoch, 0, 0
        self._active: weakref.ref | None = None
        self._pool: _workers.Pool | None = None
        self._stop_pool: weakref.finalize | None = None

    def __len__(self) -> int:
        """Batches per epoch on this process (fewer in an epoch resumed on another world size)."""
        return self._num_batches(0)

    def _num_batches(self, start: int) -> int:
        per_rank = _position.pass_length(self.sampler, start)
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

        Like torch's `sampler.set_epoch`: call it before iterating each epoch. Calling the
        sampler's `set_epoch` directly has the same effect.
        """
        epoch = _require_int("Loader.set_epoch", "epoch", epoch, 0,
                             "pass the epoch number, counted from 0")
        if epoch != self.epoch:
            self._move(epoch, 0)

    def __iter__(self) -> Iterator[dict]:
        self._follow_sampler()
        _loader_checks.not_nested(self._active() if self._active else None,
                                  (self._epoch, self._step))
        self._close_active()
        batches = self._iterate()
        self._active = weakref.ref(batches)
        return batches

    def _iterate(self) -> Iterator[dict]:
        indices, real = _position.pass_rows(self.sampler, self._start)
        plan = _batches.EpochPlan(indices, real, self.batch_size, self.sampler.seed, self._epoch)
        items = range(self._step, self._num_batches(self._start))
        host, place = self._host_batches(plan, items), self._place

        def build(b: int) -> dict:
            return place(host(b))

        with contextlib.closing(_prefetch.prefetched(build, items, self.prefetch,
                                                     self.timeout)) as batches:
            for batch in batches:
                self._step += 1
                _progress.record("data")  # a rank stuck reading shows phase "data"
                yield batch
        self._active = None  # finished: _move must not close this (running) generator
        self._move(self._epoch + 1, 0)

    def _host_batches(self, plan: _batches.EpochPlan, items: range) -> Callable[[int], dict]:
        """`b -> host batch b`: built here, or asked of the worker processes."""
        if not self.num_workers:
            return functools.partial(_batches.host_batch, self._recipe, plan)
        if self._pool is not None and self._pool.broken:
            self._stop_workers()
        if self._pool is None:
            self._pool = _workers.Pool(self._recipe, self.num_workers)
            self._stop_pool = weakref.finalize(self, self._pool.close)
        return self._pool.start_pass(plan, items, ahead=2 * self.num_workers)

    def close(self) -> None:
        """Stop the worker processes now (idempotent; the next iteration starts new ones).

        Workers also stop when the Loader is garbage-collected and at interpreter exit.
        """
        self._close_active()
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
            examples of the epoch consumed by all processes together (see `load_state_dict`);
            the rank is not included, so process 0's copy restores every process. An epoch whose
            last batch was taken (a loop that left at it, e.g. on preemption) is saved as the
            start of the next one: a resumed `range(loader.epoch, num_epochs)` loop goes on
            there instead of re-entering an epoch with nothing left.
        """
        s, epoch, step, start = self.sampler, self.epoch, self.step, self._start
        if step and step == self._num_batches(start):
            epoch, step, start = epoch + 1, 0, 0
        at = _position.offset(s, _position.Position(epoch, start, step), self.batch_size)
        return {"epoch": epoch, "step": step, "start": start, "offset": at,
                "num_examples": s.num_examples, "num_replicas": s.num_replicas,
                "shuffle": s.shuffle, "seed": s.seed, "sampler_drop_last": s.drop_last,
                "batch_size": self.batch_size, "drop_last": self.drop_last}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from a position saved by `state_dict()`.

        With the same number of processes and batch size the same remaining batches follow
        (bitwise). With another (an elastic restart), the epoch continues with exactly the
        examples no process had consumed, each once, split over the new processes as a fresh
        epoch would be (torch's padding, masked); the next epochs are whole as usual.

        Raises:
            ValueError: the saved dataset size, shuffle, seed or sampler drop_last differ from
                this loader's (the epoch's order would differ), or the position is outside it.
        """
        pos = _position.restored(state, self.state_dict(), self._num_batches)
        self._move(pos.epoch, pos.step, pos.start)

    def _move(self, epoch: int, step: int, start: int = 0) -> None:
        self._close_active()
        self.sampler.set_epoch(epoch)
        self._epoch, self._start, self._step = epoch, start, step

    def _follow_sampler(self) -> None:
        # Someone called sampler.set_epoch(e) directly (the torch habit): treat it as ours.
        if self.sampler.epoch != self._epoch:
            self._move(self.sampler.epoch, 0)

    def _close_active(self) -> None:
        active = self._active() if self._active is not None else None
        self._active = None
        if active is not None:
            active.close()

    def __repr__(self) -> str:
        return (f"Loader(batch_size={self.batch_size}, layout={self.layout!r}, devices="
                f"{len(self.devices)}, num_workers={self.num_workers}, drop_last="
                f"{self.drop_last}, epoch={self._epoch}, step={self._step}, len={len(self)}, "
                f"sampler={self.sampler!r})")
