"""A step's options, checked once when the step is made (a bad value is a one-line error then,
not when the step runs), and `shard_params` resolved to the devices a parameter is split over.
"""
from __future__ import annotations

import operator
from typing import Any

import jax.numpy as jnp
import numpy as np

from jdp.distributed import devices_per_node
from jdp.job import values
from jdp.spmd import mesh as _mesh

MAX_IN_FLIGHT = 16


SHARD_PARAMS = ('True or False, "node", or an int >= 2 that divides the device count (HSDP: '
                'groups of that many consecutive devices)')


def train_options(grad_reduce: str, accum_steps: int, model_state_sync: Any,
                  max_in_flight: int, comm_dtype: Any = None, *, who: str = "") -> dict:
    """Check a step's options (once, when the step is made) by `jdp.job.values`' rules;
    returns them as the step uses them (a NumPy integer as an int)."""
    checked = {
        "grad_reduce": values.choice(who, "grad_reduce", grad_reduce, ("mean", "sum"),
                                     fix="'mean' averages the gradients as DDP does"),
        "accum_steps": values.integer(who, "accum_steps", accum_steps, minimum=1,
                                      fix="the micro-batches per step (1: no accumulation)"),
        "model_state_sync": values.choice(
            who, "model_state_sync", model_state_sync, ("mean", None),
            fix="for SyncBatchNorm build the model with nn.BatchNorm(axis_name=jdp.AXIS)"),
        "max_in_flight": values.integer(
            who, "max_in_flight", max_in_flight, minimum=1, maximum=MAX_IN_FLIGHT,
            fix="hundreds of queued multi-device all-reduces can stall XLA's CPU rendezvous, "
                "and 2 already keeps the devices busy"),
    }
    if comm_dtype is not None and not _is_float_dtype(comm_dtype):
        raise ValueError(f"{who + ': ' if who else ''}comm_dtype={comm_dtype!r}: expected a "
                         "floating dtype such as jnp.bfloat16 (gradients would be truncated), "
                         "or None")
    return checked


def bool_options(who: str = "", **options: Any) -> dict:
    """Flags must be True or False (a truthy number or string is a mistake, not a choice);
    returns them as Python bools."""
    return {option: values.flag(who, option, value) for option, value in options.items()}


def fsdp_comm_dtype(shard_params: Any, comm_dtype: Any, compute_dtype: Any) -> None:
    """Under FSDP over all devices the compiler reduces each layer's gradient where it is
    computed, in the compute dtype: a different `comm_dtype` cannot be honoured. (HSDP's
    `shard_params=k` or "node" sends its one reduction across the groups in `comm_dtype`.)"""
    reduced = jnp.dtype(compute_dtype or jnp.float32)
    if shard_params is True and comm_dtype is not None and jnp.dtype(comm_dtype) != reduced:
        raise ValueError(
            f"comm_dtype={comm_dtype!r} with shard_params=True: FSDP reduces each layer's "
            f"gradient in the compute dtype ({reduced}); drop comm_dtype, or pass "
            f"compute_dtype={jnp.dtype(comm_dtype).name} to compute and reduce in it")


def _is_float_dtype(dtype: Any) -> bool:
    try:
        return jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        return False


def dtype_option(option: str, dtype: Any) -> None:
    """A dtype option must be a floating dtype, or None."""
    if dtype is not None and not _is_float_dtype(dtype):
        raise ValueError(f"{option}={dtype!r}: expected a floating dtype such as jnp.bfloat16, "
                         "or None")


def shard_params_option(value: Any, who: str = "jdp.train_step") -> Any:
    """`shard_params` is True/False, "node", or an int >= 2 (the group size, HSDP; groups of
    one device would be replication: False); NumPy's bools and integers count as Python's.
    Returns the value as the step uses it."""
    if values.is_bool(value):
        return bool(value)
    if isinstance(value, str):
        if value == "node":
            return value
        raise values.wrong_value(who, "shard_params", value, SHARD_PARAMS)
    try:
        group = operator.index(value)
    except TypeError:
        raise values.wrong_type(who, "shard_params", value, SHARD_PARAMS) from None
    if group < 2:
        raise values.wrong_value(who, "shard_params", value, SHARD_PARAMS)
    return group


def group_size(shard_params: Any) -> int | None:
    """The devices one parameter is split over for a `shard_params` value: None for all of
    them (True), `k` for groups of k consecutive devices, a node's devices for "node"
    (this process's devices x the processes per node); refused otherwise."""
    n = _mesh.mesh().size
    k = shard_params.item() if isinstance(shard_params, np.generic) else shard_params
    if k == "node":
        k = devices_per_node()
    if k is True:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k < 2 or n % k:
        raise ValueError(f"shard_params={shard_params!r}: expected True (all {n} devices), "
                         f"\"node\", or an int >= 2 that divides the device count {n} (HSDP: "
                         "groups of that many consecutive devices)")
    return None if k == n else k
