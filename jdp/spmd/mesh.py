"""The device axis jdp works over: its name, the one data mesh, and the two shardings on it.

The state is placed `replicated()` on `mesh()` (or, for ZeRO's optimizer state, sharded like a
batch); batches are `batch_sharded()`: their leading axis split along `AXIS`.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

AXIS = "batch"
"""Name of the device axis inside jdp's parallel steps (`lax.pmean(x, jdp.AXIS)`,
`nn.BatchNorm(axis_name=jdp.AXIS)`)."""


@functools.cache
def mesh() -> Mesh:
    """The data mesh: one axis, `jdp.AXIS`, over every device of every process.

    Devices are ordered process-major (a process's devices adjacent, by id), so every process
    builds the same mesh and rank r's examples sit on rank r's devices; on one process the
    order is `jax.local_devices()`. The axis type is given explicitly (`Auto`: the compiler
    places what the step does not) rather than left to `jax.make_mesh`'s default, which
    changed in JAX 0.8.1. Built once per process.

    Example:
        >>> import jdp
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
    """Every device of `mesh()` holds the whole array (the state)."""
    return NamedSharding(mesh(), PartitionSpec())


def batch_sharded() -> NamedSharding:
    """The leading axis split over `mesh()` (batches, ZeRO's optimizer state)."""
    return NamedSharding(mesh(), PartitionSpec(AXIS))


def place(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host value every process holds: each device gets its part."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def place_rows(rows: object) -> object:
    """This process's rows `[local_devices*b, ...]` (a pytree of host arrays) as its part of
    global arrays `[all_devices*b, ...]` split along `AXIS`, without an extra host copy."""
    sharding = batch_sharded()
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), rows)


REPLICA, SHARD = "jdp_replica", "jdp_shard"
"""The axes of `group_mesh`: across the groups of devices (HSDP's replicas), and within one."""


@functools.cache
def group_mesh(k: int) -> Mesh:
    """`mesh()`'s devices in groups of `k` consecutive ones (HSDP: a node's devices): axis
    `SHARD` within a group, `REPLICA` across the groups. Same devices, same order as `mesh()`,
    so a batch split along `AXIS` is split the same way over (`REPLICA`, `SHARD`)."""
    return Mesh(mesh().devices.reshape(-1, k), (REPLICA, SHARD),
                axis_types=(AxisType.Auto, AxisType.Auto))
