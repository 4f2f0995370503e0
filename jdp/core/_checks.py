"""Input checks for the parallel steps, raised before anything enters pmap.

Each error names the offending value, what was expected, and the fix, because inside pmap the
same mistakes surface as shape errors deep in XLA.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jdp.core import _state

MAX_IN_FLIGHT = 16

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
    if not isinstance(max_in_flight, int) or not 1 <= max_in_flight <= MAX_IN_FLIGHT:
        raise ValueError(f"max_in_flight={max_in_flight!r}: expected an int in 1..{MAX_IN_FLIGHT}; "
                         "hundreds of queued multi-device all-reduces can stall XLA's CPU "
                         "rendezvous, and 2 already keeps the devices busy")

def backend(name: str) -> None:
    """The parallel backend must be one jdp has."""
    if name not in ("pmap", "shard_map"):
        raise ValueError(f"backend={name!r}: expected 'pmap' (default) or 'shard_map'")

def layout_options(layout: str, shard_optimizer: bool) -> None:
    """Options that only one layout has."""
    if shard_optimizer and layout != _state.GLOBAL:
        raise ValueError("shard_optimizer=True needs the global layout: place the state with "
                         "jdp.broadcast(state, shard_optimizer=True), not jdp.replicate")


def name(path) -> str:
    """A tree path as users write it (`['params']['w']`), or <root>."""
    return jax.tree_util.keystr(path) or "<root>"

def state_layout(state: Any) -> str:
    """The layout the state is in; ValueError naming a leaf that is in neither."""
    found = _state.layout(state)
    if found is not None:
        return found
    leaves = jax.tree_util.tree_flatten_with_path(getattr(state, "params", state))[0]
    if not leaves:
        raise ValueError(f"state {type(state).__name__} has no array leaves: pass the train state")
    path, leaf = leaves[0]
    where = f"a {type(leaf).__name__} of shape {jnp.shape(leaf)}"
    raise ValueError(
        f"state leaf {name(path)} is {where} on no jdp layout: expected one copy per local "
        f"device (pmap layout: pass the state through jdp.replicate(state) first) or a global "
        f"array on jdp.mesh() (global layout: jdp.broadcast(state))")

def not_donated(state: Any) -> None:
    """A state whose buffers went to an earlier step (donation) cannot be used again."""
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(x, jax.Array) and x.is_deleted():
            raise RuntimeError(
                f"state leaf {name(path)} was donated to an earlier step (its buffers now hold "
                "that step's output): use the state the step returned, `state, metrics = "
                "step(state, batch)`, or build the step with donate=False to keep old states")

def batch(tree: Any, layout: str, accum_steps: int = 1) -> None:
    """Batch leaves must fit the layout: `[n, b, ...]` stacked, `[n*b, ...]` global."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not leaves:
        raise ValueError("batch is empty: expected a pytree of arrays")
    if layout == _state.GLOBAL:
        return _global_batch(leaves, accum_steps)
    n = jax.local_device_count()
    per_device = None
    for path, x in leaves:
        shape = jnp.shape(x)
        if len(shape) < 2 or shape[0] != n:
            raise ValueError(
                f"batch leaf {name(path)} has shape {shape}: expected [{n}, per_device_batch, "
                f"...] with a leading axis of {n} local devices; split it with jdp.shard(batch) "
                f"or feed it through jdp.data.Loader")
        if per_device is None:
            per_device, first = shape[1], name(path)
        elif shape[1] != per_device:
            raise ValueError(
                f"batch leaf {name(path)} has {shape[1]} examples per device but {first} has "
                f"{per_device}: every leaf needs the same per-device batch")
    if per_device % accum_steps:
        raise ValueError(f"per-device batch {per_device} is not divisible by accum_steps="
                         f"{accum_steps}: pick a batch size that is a multiple of "
                         f"{accum_steps} x {n} devices")

def _global_batch(leaves: list, accum_steps: int) -> None:
    """Global batch leaves: one leading size, split evenly over all devices and micro-batches."""
    n = jax.device_count()
    size = first = None
    for path, x in leaves:
        shape = jnp.shape(x)
        if _state.is_stacked_placement(x):
            raise ValueError(f"batch leaf {name(path)} is in the pmap layout [local_devices, "
                             "...] but the state is global: use Loader(..., layout='global') or "
                             "jdp.shard(batch, layout='global')")
        if jax.process_count() > 1 and not isinstance(x, jax.Array):
            raise ValueError(f"batch leaf {name(path)} is a host {type(x).__name__}: on "
                             f"{jax.process_count()} processes the global layout needs global "
                             "arrays; use Loader(..., layout='global') or jdp.shard(batch, "
                             "layout='global')")
        if not shape or shape[0] % (n * accum_steps):
            raise ValueError(f"batch leaf {name(path)} has shape {shape}: the global batch must "
                             f"split evenly over {n} devices x accum_steps={accum_steps}; use a "
                             f"global batch size that is a multiple of {n * accum_steps}")
        if size is None:
            size, first = shape[0], name(path)
        elif shape[0] != size:
            raise ValueError(f"batch leaf {name(path)} has {shape[0]} examples but {first} has "
                             f"{size}: every leaf needs the same batch size")

def state_in_layout(state: Any, layout: str, shard_optimizer: bool) -> None:
    """Every leaf of the state is placed as its layout (and ZeRO) requires."""
    if layout == _state.STACKED:
        return replicated_state(state, jax.local_device_count())
    opt = getattr(state, "opt_state", None)
    for path, x in jax.tree_util.tree_flatten_with_path(state.replace(opt_state=None) if (
            shard_optimizer and opt is not None) else state)[0]:
        if _state.layout_of_leaf(x) != _state.GLOBAL or not x.sharding.is_fully_replicated:
            raise ValueError(f"state leaf {name(path)} is not replicated on jdp.mesh(): place "
                             "the whole state with jdp.broadcast(state)")
    if shard_optimizer:
        from jdp.core import _zero
        logical = jax.eval_shape(state.tx.init, state.params)
        if not _zero.is_stored(opt, logical):
            raise ValueError("shard_optimizer=True: the optimizer state is not sharded; place "
                             "the state with jdp.broadcast(state, shard_optimizer=True)")

def replicated_state(tree: Any, n: int) -> None:
    """Every leaf must carry one copy per local device (what `jdp.replicate` makes)."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = jnp.shape(x)
        single = (isinstance(x, jax.Array) and n > 1 and len(x.sharding.device_set) == 1)
        if not shape or shape[0] != n or single:
            where = "on one device" if single else f"of shape {shape}"
            raise ValueError(
                f"state leaf {name(path)} is {where}: expected one copy per local device "
                f"(leading axis {n}); pass the state through jdp.replicate(state) first")

def signature(state: Any, tree: Any) -> tuple:
    """Hashable structure + shapes of the step's inputs: checks run once per signature."""
    leaves, treedef = jax.tree.flatten((state, tree))
    # Attribute reads, not jnp.shape/result_type: this runs on every step.
    return treedef, tuple((getattr(x, "shape", None), getattr(x, "dtype", type(x)))
                          for x in leaves)

def trace(parallel_step: Callable, state: Any, tree: Any, stop: Any) -> None:
    """Trace the parallel step abstractly once per signature, so errors in the user's function
    surface here, before anything runs or is donated."""
    jax.eval_shape(parallel_step, state, tree, stop)


def loss_output(out: Any, has_aux: bool, has_model_state: bool) -> tuple:
    """(loss, aux, new_model_state) from what the loss returned, or a TypeError that names
    the form expected for this `has_aux` and model state."""
    form = {(False, False): "loss", (True, False): "(loss, metrics)",
            (False, True): "(loss, new_model_state)",
            (True, True): "(loss, (metrics, new_model_state))"}[(has_aux, has_model_state)]
    why = (f"with has_aux={has_aux} and {'a' if has_model_state else 'no'} model state in the "
           f"train state, loss_fn must return {form}")
    pair = isinstance(out, (tuple, list)) and len(out) == 2
    if not has_aux and not has_model_state:
        if isinstance(out, (tuple, list)):
            raise TypeError(f"loss_fn returned a {type(out).__name__} of {len(out)}: {why}; "
                            "pass has_aux=True to return (loss, metrics)")
        return out, {}, None
    if not pair:
        raise TypeError(f"loss_fn returned {_describe(out)}: {why}")
    if has_aux and has_model_state:
        if not (isinstance(out[1], (tuple, list)) and len(out[1]) == 2):
            raise TypeError(f"loss_fn returned (loss, {_describe(out[1])}): {why}")
        return out[0], out[1][0], out[1][1]
    return (out[0], out[1], None) if has_aux else (out[0], {}, out[1])


def new_model_state(old: Any, new: Any, has_aux: bool) -> None:
    """The model state the loss returns must have the structure of the one it got: else the
    next step would call the loss with something else (e.g. `(metrics, stats)` taken for the
    statistics when `has_aux=True` was forgotten)."""
    if jax.tree.structure(old) != jax.tree.structure(new):
        hint = "" if has_aux else (
            "; if it returns (loss, (metrics, new_model_state)), pass has_aux=True")
        raise TypeError(f"loss_fn returned a new model state structured as "
                        f"{jax.tree.structure(new)}, but the train state's is "
                        f"{jax.tree.structure(old)}: return the updated model state itself{hint}")


def _describe(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a {type(x).__name__} of shape {jnp.shape(x)}" if hasattr(x, "shape") else (
        f"a {type(x).__name__}")


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
