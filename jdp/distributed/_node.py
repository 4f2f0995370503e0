"""A node's share of the job: how many processes, and so devices, share this machine.

HSDP's `shard_params="node"` splits the model over one node's devices. Each engine says how
many processes it started on this machine in its own way; `processes_per_node` reads them and
`devices_per_node` makes every process agree on the result, so that nodes of different sizes
are a one-line error instead of processes compiling different steps.
"""
from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping

import jax

from jdp.distributed import _engines, _group


def processes_per_node(env: Mapping[str, str] | None = None) -> int:
    """This machine's process count as the engine that started the job says: jdp.launch's or
    torchrun's LOCAL_WORLD_SIZE, Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE, SLURM's step or job
    tasks per node, Ray Train's local world size; 1 when none does (a single process, JAX's
    own variables or a Kubernetes pod: one process per machine)."""
    env = os.environ if env is None else env
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if env.get(name, "").isdigit():
            return int(env[name])
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if name in env:
            return _slurm_tasks_here(env[name], env.get("SLURM_NODEID", "0"))
    ray = _engines.ray_train_context()
    return 1 if ray is None else ray.get_local_world_size()


def _slurm_tasks_here(value: str, node_id: str) -> int:
    """This node's entry of SLURM's compressed list ("4(x2),3": 4, 4, 3), by SLURM_NODEID."""
    counts = []
    for count, times in re.findall(r"(\d+)(?:\(x(\d+)\))?", value):
        counts += [int(count)] * int(times or 1)
    if not counts:
        raise ValueError(f"SLURM tasks per node {value!r} is not SLURM's list (e.g. '4(x2)')")
    node = int(node_id) if node_id.isdigit() else 0
    return counts[node] if node < len(counts) else counts[0]


@functools.cache
def devices_per_node() -> int:
    """The devices of one node (this process's x `processes_per_node`), the same on every
    process or a ValueError on all of them naming the processes that differ."""
    count = jax.local_device_count() * processes_per_node()
    _group.agree("devices per node", [("devices per node", str(count))],
                 'shard_params="node"', "nodes must hold the same number of devices; pass "
                 "shard_params=k with k dividing every node's device count")
    return count
