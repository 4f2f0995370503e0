"""jdp: data-parallel training for JAX, in the manner of PyTorch DDP + torchrun.

A pure single-device train step becomes one that runs on every local device of every process,
with gradients averaged by `lax.pmean`::

    import jdp
    jdp.initialize()
    state = jdp.replicate(state)
    step = jdp.train_step(loss_fn)
    for batch in jdp.data.Loader(source, batch_size=256):
        state, metrics = step(state, batch)
"""
from jdp.distributed import broadcast_from_primary, is_primary
from jdp.state import TrainState, replicate, shard, unreplicate
from jdp.step import AXIS, eval_step, reduce_gradients, train_step

__version__ = "0.1.0"

__all__ = [
    "AXIS",
    "TrainState",
    "broadcast_from_primary",
    "eval_step",
    "is_primary",
    "reduce_gradients",
    "replicate",
    "shard",
    "train_step",
    "unreplicate",
]
