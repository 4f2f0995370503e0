"""Argument checks of `jdp.data.Loader`: each a one-line error naming the value and the fix."""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import jax

from jdp.core import _mesh
from jdp.data._sampler import DistributedSampler


def default_sampler(sampler: DistributedSampler | None, num_examples: int,
                    shuffle: bool | None, seed: int | None) -> DistributedSampler:
    """The sampler given (checked against the source), or one over all processes."""
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
                         f"the source has {num_examples} examples; build it as "
                         f"DistributedSampler({num_examples}, ...)")
    return sampler


def layout(value: Any, devices: Sequence[jax.Device] | None) -> str:
    """`value` if it is a layout name; devices= only goes with the pmap layout."""
    if not isinstance(value, str) or value not in _mesh.LAYOUTS:
        raise ValueError(f"Loader: layout={value!r}; expected one of {_mesh.LAYOUTS} ('pmap': "
                         "[local_devices, per_device, ...] arrays, 'global': [global_batch, ...])")
    if value == "global" and devices is not None:
        raise ValueError("Loader: devices= was given with layout='global', whose batches are "
                         "split over jdp.mesh(); drop devices= or use layout='pmap'")
    return value


def loader_args(loader: Any, num_examples: int) -> None:
    """Devices, batch size, transform and timeout fit together."""
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
    if loader.timeout is not None and (isinstance(loader.timeout, bool) or not isinstance(
            loader.timeout, (int, float)) or not loader.timeout > 0):
        raise ValueError(f"Loader: timeout={loader.timeout!r}; expected seconds > 0 or None")
    if loader.drop_last and len(loader) == 0:
        raise ValueError(f"Loader: drop_last=True with batch_size={loader.batch_size} leaves no "
                         f"batch of the {len(loader.sampler)} examples this process gets (of "
                         f"{num_examples}); use a smaller batch_size or drop_last=False")


def not_nested(active: Any, position: tuple) -> None:
    """Refuse a second iterator while one is active: they would share (and split) one position."""
    if active is not None and inspect.getgeneratorstate(active) in (
            inspect.GEN_SUSPENDED, inspect.GEN_RUNNING):
        raise RuntimeError(f"Loader: iter(loader) while an earlier iterator over it is still "
                           f"active at (epoch, step)={position}: nested loops over one Loader "
                           "would share its position; finish, break out of or close() the "
                           "first loop, or build a second Loader for the inner one")
