"""jdp: data-parallel training for JAX, in the manner of PyTorch DDP + torchrun.

A pure single-device train step becomes one that runs on every device of every process, with
gradients averaged by `lax.pmean`::

    import jdp
    jdp.initialize()
    state = jdp.broadcast(state)                  # or jdp.replicate(state): the pmap form
    step = jdp.train_step(loss_fn)
    for batch in jdp.data.Loader(source, batch_size=256, layout="global"):
        state, metrics = step(state, batch)
"""
from jdp import data, datasets
from jdp._log import get_logger, print0
from jdp._progress import preempted
from jdp.data import DistributedSampler, Loader
from jdp.distributed import (
    barrier,
    broadcast_from_primary,
    initialize,
    is_primary,
    process_count,
    process_index,
    shutdown,
)
from jdp.spawn import ProcessExitedException, ProcessRaisedException, spawn
from jdp.core import AXIS, TrainState, broadcast, eval_step, mesh, reduce_gradients, train_step
from jdp.core._state import replicate, shard, unreplicate
from jdp import pmap

__version__ = "0.1.0"

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
    "datasets",
    "eval_step",
    "get_logger",
    "initialize",
    "is_primary",
    "mesh",
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
]


def __getattr__(name: str):
    # On demand: `jdp.launch` (importing it eagerly makes `python -m jdp.launch` warn, runpy),
    # and the checkpoint module, whose orbax import costs every `import jdp` ~0.5 s otherwise.
    import importlib

    if name in ("launch", "checkpoint"):
        return importlib.import_module(f"jdp.{name}")
    if name == "Checkpointer":
        return importlib.import_module("jdp.checkpoint").Checkpointer
    raise AttributeError(f"module 'jdp' has no attribute {name!r}")
