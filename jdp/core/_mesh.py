"""The device axis jdp works over: its name, the one data mesh, and the shardings on it.

The global layout places arrays on `mesh()`: the state `replicated()`, batches `batch_sharded()`
along `AXIS`. The stacked (pmap) layout places `[local_devices, ...]` arrays with
`local_sharding()`, slice i on local device i.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

GLOBAL, STACKED = "global", "pmap"
LAYOUTS = (STACKED, GLOBAL)
"""jdp's two layouts: global arrays on `mesh()`, or stacked `[local_devices, ...]` (pmap)."""

AXIS = "batch"
"""Name of the device axis inside jdp's parallel steps (`lax.pmean(x, jdp.AXIS)`,
`nn.BatchNorm(axis_name=jdp.AXIS)`)."""


LOCAL_AXIS = "local_devices"
"""Axis name of the stacked layout's placement: it tells a stacked leaf from a global one."""


def local_sharding(devices: Sequence[jax.Device] | None = None) -> NamedSharding:
    """Sharding that puts slice i of an array's leading axis on device i of `devices`.

    The default is pmap's order (`jax.local_devices()`), so arrays placed with it enter a
    pmapped step without a copy. Its axis is `LOCAL_AXIS`, not `AXIS`: on one process a
    stacked `[8, b]` array and a global batch of 8 rows have the same devices and shape, and
    only the name says which layout it is in.
    """
    devices = jax.local_devices() if devices is None else list(devices)
    return NamedSharding(Mesh(np.array(devices), (LOCAL_AXIS,)), PartitionSpec(LOCAL_AXIS))


@functools.cache
def mesh() -> Mesh:
    """The data mesh: one axis, `jdp.AXIS`, over every device of every process.

    Devices are ordered process-major (a process's devices adjacent, by id), so every process
    builds the same mesh and rank r's examples sit on rank r's devices; on one process the
    order is `jax.local_devices()`, pmap's. The axis type is given explicitly (`Auto`: the
    compiler places what the step does not) rather than left to `jax.make_mesh`'s default,
    which changed in JAX 0.8.1. Built once per process.

    Example:
        >>> m = jdp.mesh()
        >>> m.axis_names == (jdp.AXIS,) and m.size == jax.device_count()
        True
    """
    if jax.process_count() == 1:
        devices = jax.local_devices()
    else:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices), (AXIS,), axis_types=(AxisType.Auto,))


def replicated() -> NamedSharding:
    """Every device of `mesh()` holds the whole array (the global layout's state)."""
    return NamedSharding(mesh(), PartitionSpec())


def batch_sharded() -> NamedSharding:
    """The leading axis split over `mesh()` (the global layout's batches)."""
    return NamedSharding(mesh(), PartitionSpec(AXIS))


def place_batch(host: Any, layout: str, sharding: NamedSharding | None = None) -> Any:
    """Put this process's rows `[n*b, ...]` (a pytree of host arrays) on the devices.

    STACKED: `[n, b, ...]`, slice i on device i of `sharding` (default `local_sharding()`).
    GLOBAL: this process's part of global `[processes*n*b, ...]` arrays split along `AXIS`
    over `mesh()` (`jax.make_array_from_process_local_data`: no extra host copy).
    """
    if layout == GLOBAL:
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
            batch_sharded(), np.asarray(x)), host)
    sharding = sharding or local_sharding()
    n = sharding.mesh.size
    return jax.device_put(jax.tree.map(
        lambda x: np.asarray(x).reshape(n, -1, *np.shape(x)[1:]), host), sharding)
