"""Input checks for the parallel steps, raised before anything enters pmap.

Each error names the offending value, what was expected, and the fix, because inside pmap the
same mistakes surface as shape errors deep in XLA.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jdp._mesh import AXIS


def train_options(grad_reduce: str, accum_steps: int, model_state_sync: Any,
                  max_in_flight: int) -> None:
    """Check `jdp.train_step`'s options."""
    if grad_reduce not in ("mean", "sum"):
        raise ValueError(f"grad_reduce={grad_reduce!r}: expected 'mean' (DDP) or 'sum'")
    if not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps={accum_steps!r}: expected an int >= 1 (1: no accumulation)")
    if model_state_sync not in ("mean", None):
        raise ValueError(f"model_state_sync={model_state_sync!r}: expected 'mean' or None; for "
                         f"SyncBatchNorm build the model with nn.BatchNorm(axis_name=jdp.AXIS)")
    if not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise ValueError(f"max_in_flight={max_in_flight!r}: expected an int >= 1")


def backend(name: str) -> None:
    """The parallel backend must be one jdp has."""
    if name not in ("pmap", "shard_map"):
        raise ValueError(f"backend={name!r}: expected 'pmap' (default) or 'shard_map'")


def _name(path) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def batch(tree: Any, n: int, accum_steps: int = 1) -> None:
    """Leaves must be `[n, b, ...]` with one b for all, divisible by `accum_steps`."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not leaves:
        raise ValueError("batch is empty: expected a pytree of arrays [local_devices, batch, ...]")
    per_device = None
    for path, x in leaves:
        shape = jnp.shape(x)
        if len(shape) < 2 or shape[0] != n:
            raise ValueError(
                f"batch leaf {_name(path)} has shape {shape}: expected [{n}, per_device_batch, "
                f"...] with a leading axis of {n} local devices; split it with jdp.shard(batch) "
                f"or feed it through jdp.data.Loader")
        if per_device is None:
            per_device, first = shape[1], _name(path)
        elif shape[1] != per_device:
            raise ValueError(
                f"batch leaf {_name(path)} has {shape[1]} examples per device but {first} has "
                f"{per_device}: every leaf needs the same per-device batch")
    if per_device % accum_steps:
        raise ValueError(f"per-device batch {per_device} is not divisible by accum_steps="
                         f"{accum_steps}: pick a batch size that is a multiple of "
                         f"{accum_steps} x {n} devices")


def replicated_state(tree: Any, n: int) -> None:
    """Every leaf must carry one copy per local device (what `jdp.replicate` makes)."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = jnp.shape(x)
        single = (isinstance(x, jax.Array) and n > 1 and len(x.sharding.device_set) == 1)
        if not shape or shape[0] != n or single:
            where = "on one device" if single else f"of shape {shape}"
            raise ValueError(
                f"state leaf {_name(path)} is {where}: expected one copy per local device "
                f"(leading axis {n}); pass the state through jdp.replicate(state) first")


def signature(state: Any, tree: Any) -> tuple:
    """Hashable structure + shapes of the step's inputs: checks run once per signature."""
    leaves, treedef = jax.tree.flatten((state, tree))
    # Attribute reads, not jnp.shape/result_type: this runs on every step.
    return treedef, tuple((getattr(x, "shape", None), getattr(x, "dtype", type(x)))
                          for x in leaves)


def trace_per_device(device_fn: Callable, state: Any, tree: Any) -> None:
    """Trace the per-device step abstractly (vmap binds the axis name) so errors in the
    user's function surface here, with a plain traceback, instead of inside pmap."""
    jax.eval_shape(jax.vmap(device_fn, axis_name=AXIS), state, tree)


def scalar_loss(loss: Any) -> None:
    """The loss must be a scalar: the mean (or sum) over one device's examples."""
    if jnp.shape(loss) != ():
        raise ValueError(f"loss_fn returned a loss of shape {jnp.shape(loss)}: expected a scalar; "
                         f"reduce it over the examples, e.g. jnp.mean(per_example_loss)")


def per_example(values: Any, b: int) -> None:
    """Eval metrics must be a dict of per-example values `[b]`."""
    if not isinstance(values, dict):
        raise TypeError(f"metric_fn returned {type(values).__name__}: expected a dict of "
                        f"per-example values of shape [{b}]")
    for k, v in values.items():
        if jnp.shape(v) != (b,):
            raise ValueError(f"metric_fn value {k!r} has shape {jnp.shape(v)}: expected "
                             f"per-example values of shape [{b}]; return e.g. (pred == label) "
                             f"per example, "
                             f"not its mean")
