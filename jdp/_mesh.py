"""The device axis jdp works over: its name and the sharding of per-device arrays."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "batch"
"""Name of the device axis inside jdp's parallel steps (`lax.pmean(x, jdp.AXIS)`,
`nn.BatchNorm(axis_name=jdp.AXIS)`)."""


def local_sharding() -> NamedSharding:
    """Sharding that puts slice i of an array's leading axis on local device i.

    The device order is pmap's (`jax.local_devices()`), so arrays placed with it enter a
    pmapped step without a copy.
    """
    mesh = Mesh(np.array(jax.local_devices()), (AXIS,))
    return NamedSharding(mesh, PartitionSpec(AXIS))
