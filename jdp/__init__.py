"""jdp: data-parallel training for JAX on global arrays, with its launcher.

A pure single-device train step becomes one that runs on every device of every process, with
gradients averaged by `lax.pmean`::

    import jdp
    jdp.initialize()
    state = jdp.broadcast(state)                  # global arrays on jdp.mesh()
    step = jdp.train_step(loss_fn)
    for batch in jdp.data.Loader(source, batch_size=256):
        state, metrics = step(state, batch)

The classic pmap form (stacked state, a real `jax.pmap`) is `jdp.pmap`.
"""
from jdp import checkpoint, data, launch, metrics, pmap, train_step  # train_step: a callable module
from jdp.checkpoint import Checkpointer
from jdp.core import (
    AXIS,
    TrainState,
    broadcast,
    eval_step,
    mesh,
    reduce_gradients,
    shard,
    unshard,
)
from jdp.data import DistributedSampler, Loader, evaluate
from jdp.distributed import (
    barrier,
    broadcast_from_primary,
    get_logger,
    initialize,
    is_primary,
    print0,
    process_count,
    process_index,
    shutdown,
)
from jdp.job import preempted
from jdp.launch import ProcessExitedException, ProcessRaisedException, spawn
from jdp.pmap import replicate, unreplicate  # the classic form's top-level names

__version__ = "0.4.0"   # the one place: pyproject.toml reads it (CHANGELOG.md)

__all__ = [
    "AXIS",
    "Checkpointer",
    "DistributedSampler",
    "Loader",
    "ProcessExitedException",
    "ProcessRaisedException",
    "TrainState",
    "barrier",
    "broadcast",
    "broadcast_from_primary",
    "checkpoint",
    "data",
    "eval_step",
    "evaluate",
    "get_logger",
    "initialize",
    "launch",
    "is_primary",
    "mesh",
    "metrics",
    "pmap",
    "preempted",
    "print0",
    "process_count",
    "process_index",
    "reduce_gradients",
    "replicate",
    "shard",
    "shutdown",
    "spawn",
    "train_step",
    "unreplicate",
    "unshard",
]

