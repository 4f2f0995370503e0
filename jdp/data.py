"""Feeding data-parallel steps: `DistributedSampler` (torch semantics), `Loader`, `ArraySource`.

`DistributedSampler` splits the example indices of one epoch over the processes exactly as
`torch.utils.data.DistributedSampler` does. `Loader` reads this process's examples a batch at a
time, splits each batch over the local devices (`[local_devices, per_device, ...]`), adds
`batch["mask"]` (False for padding) and puts batches on the devices ahead of use in a background
thread. `ArraySource` holds in-memory examples as a dict of arrays (the fast path). The Loader's
position (`epoch`, `step`) is resumable through `state_dict()`::

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
"""
from __future__ import annotations

import contextlib
import functools
import numbers
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding

from jdp import _mesh, _prefetch, _sources
from jdp._sampler import DistributedSampler, _require_int
from jdp._sources import ArraySource

__all__ = ["ArraySource", "DistributedSampler", "Loader"]


class _Plan(NamedTuple):
    """What building batch b of one epoch needs (no Loader reference; picklable for workers)."""
    read: _sources.Reader
    indices: np.ndarray
    real: np.ndarray
    batch_size: int
    transform: Callable[[dict], dict] | None


def _host_batch(plan: _Plan, b: int) -> dict:
    """Batch b of the plan as host numpy arrays `[batch_size, ...]`, mask included."""
    size = plan.batch_size
    idx = plan.indices[b * size:(b + 1) * size]
    real = plan.real[b * size:(b + 1) * size]
    if len(idx) < size:  # last partial batch: fill with repeats of its rows, masked out
        real = np.concatenate([real, np.zeros(size - len(idx), bool)])
        idx = np.resize(idx, size)
    fields = plan.read(idx)
    if plan.transform is not None:
        fields = _check_transformed(plan.transform(fields), size)
    return {**fields, _sources.MASK: real}


LAYOUTS = ("pmap", "global")
"""`Loader(layout=...)` values: stacked per-device arrays, or one global array per leaf."""


def _placer(layout: str, devices: Sequence[jax.Device] | None) -> Callable[[dict], dict]:
    """The function putting a host batch on the devices in `layout`."""
    if layout == "global":
        return functools.partial(_place_global, _mesh.batch_sharded())
    return functools.partial(_place_stacked, _mesh.local_sharding(devices))


def _place_stacked(sharding: NamedSharding, host: dict) -> dict:
    """`[n * b, ...]` host rows as `[n, b, ...]`, slice i on device i (pmap's layout)."""
    n = sharding.mesh.size
    return jax.device_put(jax.tree.map(
        lambda x: np.asarray(x).reshape(n, -1, *np.shape(x)[1:]), host), sharding)


def _place_global(sharding: NamedSharding, host: dict) -> dict:
    """This process's rows as its part of global `[batch_size * processes, ...]` arrays."""
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), host)


def _check_transformed(fields: Any, size: int) -> dict:
    if not isinstance(fields, Mapping):
        raise TypeError(f"Loader: transform returned a {type(fields).__name__}; expected the "
                        "batch dict (transform(batch) -> batch)")
    if _sources.MASK in fields:
        raise ValueError(f"Loader: transform returned a field named {_sources.MASK!r}, which "
                         "the Loader adds itself; rename it")
    for path, leaf in jax.tree_util.tree_flatten_with_path(dict(fields))[0]:
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] != size:
            raise ValueError(f"Loader: transform returned {jax.tree_util.keystr(path)} with "
                             f"shape {np.shape(leaf)}; expected a leading axis of batch_size="
                             f"{size} (one row per example, padding rows included)")
    return dict(fields)


_STATE_CONFIG = ("num_examples", "num_replicas", "shuffle", "seed", "sampler_drop_last",
                 "batch_size", "drop_last")


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
            normalise, cast); it sees padding rows too and must keep the leading axis.
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

    Example:
        >>> loader = Loader({"x": np.zeros((100, 3)), "y": np.arange(100)}, batch_size=16)
        >>> batch = next(iter(loader))   # with 8 devices: batch["x"].shape == (8, 2, 3)
        >>> len(loader), loader.step      # 7 batches per epoch (the last one padded), 1 taken
        (7, 1)
    """

    def __init__(self, source: Any, batch_size: int, sampler: DistributedSampler | None = None,
                 *, shuffle: bool | None = None, seed: int | None = None,
                 transform: Callable[[dict], dict] | None = None, drop_last: bool = False,
                 prefetch: int = 2, devices: Sequence[jax.Device] | None = None,
                 timeout: float | None = 300.0, layout: str = "pmap"):
        num_examples, self._read = _sources.make_reader(source)
        self.sampler = _default_sampler(sampler, num_examples, shuffle, seed)
        self.layout = _check_layout(layout, devices)
        self.devices = list(jax.local_devices() if devices is None else devices)
        self.batch_size = _require_int("Loader", "batch_size", batch_size, 1,
                                       "pass the number of examples per batch on this process")
        self.drop_last, self.transform = bool(drop_last), transform
        self.prefetch = _require_int("Loader", "prefetch", prefetch, 0,
                                     "pass the number of batches to prepare ahead (0: none)")
        self.timeout = timeout
        _check_loader_args(self, num_examples)
        self._place = _placer(self.layout, devices)
        self._epoch, self._step = self.sampler.epoch, 0
        self._active: weakref.ref | None = None

    def __len__(self) -> int:
        """Batches per epoch on this process."""
        if self.drop_last:
            return len(self.sampler) // self.batch_size
        return -(-len(self.sampler) // self.batch_size)

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
        self._close_active()
        batches = self._iterate()
        self._active = weakref.ref(batches)
        return batches

    def _iterate(self) -> Iterator[dict]:
        plan = _Plan(self._read, self.sampler.indices(), ~self.sampler.is_padding(),
                     self.batch_size, self.transform)
        place = self._place

        def build(b: int) -> dict:
            return place(_host_batch(plan, b))

        items = range(self._step, len(self))
        with contextlib.closing(_prefetch.prefetched(build, items, self.prefetch,
                                                     self.timeout)) as batches:
            for batch in batches:
                self._step += 1
                yield batch
        self._active = None  # finished: _move must not close this (running) generator
        self._move(self._epoch + 1, 0)

    def state_dict(self) -> dict:
        """The position and the configuration it depends on, JSON-serialisable.

        Returns:
            `{"epoch", "step", "num_examples", "num_replicas", "shuffle", "seed",
            "sampler_drop_last", "batch_size", "drop_last"}`; the rank is not included, so
            process 0's copy restores every process.
        """
        s = self.sampler
        return {"epoch": self.epoch, "step": self.step, "num_examples": s.num_examples,
                "num_replicas": s.num_replicas, "shuffle": s.shuffle, "seed": s.seed,
                "sampler_drop_last": s.drop_last, "batch_size": self.batch_size,
                "drop_last": self.drop_last}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from a position saved by `state_dict()`: the same remaining batches follow.

        Raises:
            ValueError: the saved configuration differs from this loader's (another batch size,
                seed, data size...), so the position would not mean the same batches; or the
                position is outside this loader's epoch.
        """
        mine = self.state_dict()
        differ = {k: (state[k], mine[k]) for k in _STATE_CONFIG
                  if k in state and state[k] != mine[k]}
        if differ:
            raise ValueError(f"Loader.load_state_dict: saved vs this loader's settings differ "
                             f"{differ}; build the Loader and sampler as they were when saved")
        epoch = _require_int("Loader.load_state_dict", "epoch", state.get("epoch"), 0,
                             "pass a dict from Loader.state_dict()")
        step = _require_int("Loader.load_state_dict", "step", state.get("step"), 0,
                            "pass a dict from Loader.state_dict()")
        if step > len(self):
            raise ValueError(f"Loader.load_state_dict: step={step} is past the {len(self)} "
                             "batches of an epoch; pass a dict saved by an equal Loader")
        self._move(epoch, step)

    def _move(self, epoch: int, step: int) -> None:
        self._close_active()
        self.sampler.set_epoch(epoch)
        self._epoch, self._step = epoch, step

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
        return (f"Loader(batch_size={self.batch_size}, devices={len(self.devices)}, "
                f"drop_last={self.drop_last}, epoch={self._epoch}, step={self._step}, "
                f"len={len(self)}, sampler={self.sampler!r})")


def _default_sampler(sampler: DistributedSampler | None, num_examples: int,
                     shuffle: bool | None, seed: int | None) -> DistributedSampler:
    if sampler is None:
        return DistributedSampler(num_examples, shuffle=bool(shuffle), seed=seed or 0)
    if not isinstance(sampler, DistributedSampler):
        raise TypeError(f"Loader: sampler is a {type(sampler).__name__}; expected a "
                        "jdp.data.DistributedSampler (the Loader needs its padding positions)")
    if shuffle is not None or seed is not None:
        raise ValueError("Loader: shuffle/seed are for the default sampler; with sampler= given "
                         "pass them to the DistributedSampler instead")
    if sampler.num_examples != num_examples:
        raise ValueError(f"Loader: the sampler covers num_examples={sampler.num_examples} but "
                         f"the source has {num_examples}; build the sampler with len(source)")
    return sampler


def _check_layout(layout: Any, devices: Sequence[jax.Device] | None) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"Loader: layout={layout!r}; expected one of {LAYOUTS} ('pmap': "
                         "[local_devices, per_device, ...] arrays, 'global': [global_batch, ...])")
    if layout == "global" and devices is not None:
        raise ValueError("Loader: devices= was given with layout='global', whose batches are "
                         "split over jdp.mesh(); drop devices= or use layout='pmap'")
    return layout


def _check_loader_args(loader: Loader, num_examples: int) -> None:
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
                        "transform(batch) -> batch or None")
    if loader.timeout is not None and not loader.timeout > 0:
        raise ValueError(f"Loader: timeout={loader.timeout!r}; expected seconds > 0 or None")
    if loader.drop_last and len(loader) == 0:
        raise ValueError(f"Loader: drop_last=True with batch_size={loader.batch_size} leaves no "
                         f"batch of the {len(loader.sampler)} examples this process gets (of "
                         f"{num_examples}); use a smaller batch_size or drop_last=False")
