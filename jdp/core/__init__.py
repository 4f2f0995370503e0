"""The step core: global `jax.Array`s on one data mesh, and the steps that train on them.

The state is placed with `broadcast` (replicated, or ZeRO with the optimizer state sharded),
batches with `shard`; `train_step` and `eval_step` run one device's function on every device
of every process as `jax.jit` of `jax.shard_map` over `mesh()`, with `lax.pmean` inside.
"""
from jdp.core._mesh import AXIS, mesh
from jdp.core._state import TrainState, broadcast, shard, unshard
from jdp.core._step import eval_step, reduce_gradients, train_step

__all__ = ["AXIS", "TrainState", "broadcast", "eval_step", "mesh", "reduce_gradients", "shard",
           "train_step", "unshard"]
