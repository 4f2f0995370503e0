"""The device axis jdp works over: its name, and the layouts of per-device arrays.

Arrays that jdp hands out (replicated state, Loader batches) are process-local: a leading axis
of `jax.local_device_count()`, slice i on local device i (`local_sharding`). The shard_map
backend runs on one global mesh instead; `to_global` / `to_local` move between the two views
without copying, by regrouping the same per-device buffers.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

AXIS = "batch"
"""Name of the device axis inside jdp's parallel steps (`lax.pmean(x, jdp.AXIS)`,
`nn.BatchNorm(axis_name=jdp.AXIS)`)."""


def local_sharding(devices: Sequence[jax.Device] | None = None) -> NamedSharding:
    """Sharding that puts slice i of an array's leading axis on device i of `devices`.

    The default is pmap's order (`jax.local_devices()`), so arrays placed with it enter a
    pmapped step without a copy.
    """
    devices = jax.local_devices() if devices is None else list(devices)
    return NamedSharding(Mesh(np.array(devices), (AXIS,)), PartitionSpec(AXIS))


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


def global_sharding() -> NamedSharding:
    """The stacked layout's `[devices, ...]` arrays seen globally: slice i on mesh device i."""
    return batch_sharded()


def _regroup(x: jax.Array, sharding: NamedSharding, leading: int) -> jax.Array:
    """The same per-device buffers of `x` as one array laid out by `sharding`."""
    buffers = {s.device: s.data for s in x.addressable_shards}
    shape = (leading, *x.shape[1:])
    ordered = [buffers[d] for d in sharding.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, sharding, ordered)


def to_global(tree: Any) -> Any:
    """Process-local `[local_devices, ...]` leaves as global `[devices, ...]` arrays."""
    if jax.process_count() == 1:
        return tree
    local, target = local_sharding(), global_sharding()

    def one(x):
        if not (isinstance(x, jax.Array) and x.sharding == local):
            x = jax.device_put(x, local)
        return _regroup(x, target, jax.device_count())

    return jax.tree.map(one, tree)


def to_local(tree: Any) -> Any:
    """Global `[devices, ...]` leaves as this process's `[local_devices, ...]` arrays."""
    if jax.process_count() == 1:
        return tree
    target = local_sharding()
    return jax.tree.map(lambda x: _regroup(x, target, jax.local_device_count()), tree)
