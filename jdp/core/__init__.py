"""The step core: global `jax.Array`s on one data mesh, and the steps that train on them.

The state is placed with `broadcast` (replicated, or ZeRO with the optimizer state sharded),
batches with `shard`; `train_step` and `eval_step` run one device's function on every device
of every process as `jax.jit` of `jax.shard_map` over `mesh()`, with `lax.pmean` inside.

For jdp's other packages, not re-exported by jdp, each under its own name: `layouts`, the
interface an adapter (the pmap form) plugs its layout into; and what the pmap form, the Loader
and the Checkpointer build on: the per-device step functions, the step's dispatch (`Step`;
`TrainStep`, whose two halves `jdp.ft` drives), the option and leaf checks, placement, which
field holds the model state (`jdp.ft`), ZeRO's records and the bound on own steps in flight
(`StepWindow`).
"""
from jdp.core import layouts
from jdp.core._dispatch import Step, stop_values
from jdp.core._inflight import StepWindow
from jdp.core._inputs import batch_leaves, not_donated, one_size, trainable
from jdp.core._options import bool_options, train_options
from jdp.core._state import TrainState, broadcast, divisible_rows, shard, unshard
from jdp.core._step import (
    StepOptions,
    TrainStep,
    device_eval_step,
    device_train_step,
    eval_step,
    train_step,
)
from jdp.spmd.grads import model_state_field
from jdp.spmd.layers import layer, layer_policy
from jdp.spmd.mesh import AXIS, batch_sharded, mesh, place, replicated
from jdp.spmd.outputs import leaf_name
from jdp.spmd.strategies import reduce_gradients

__all__ = ["AXIS", "TrainState", "broadcast", "eval_step", "layer", "layer_policy", "mesh",
           "reduce_gradients", "shard", "train_step", "unshard",
           # for jdp's other packages
           "Step", "StepOptions", "StepWindow", "TrainStep", "batch_leaves", "batch_sharded",
           "bool_options", "device_eval_step", "device_train_step", "divisible_rows", "layouts",
           "leaf_name", "model_state_field", "not_donated", "one_size", "place", "replicated",
           "stop_values", "train_options", "trainable"]
