"""What the user's functions return, checked while the step traces: the loss's output in its
documented forms, the model state it hands back, the metrics' names, an evaluation's
per-example values, and the model state a `model_state_sync=None` step keeps.

Each error names the offending value, what was expected and the fix, because inside the
compiled step the same mistakes surface as shape errors deep in XLA.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jdp.spmd import mesh as _mesh


def hsdp_loss_collectives(comm_dtype: Any, group: int) -> None:
    """HSDP with a loss that communicates over `jdp.AXIS`: the gradient is reduced across the
    groups layer by layer (as FSDP's), so `comm_dtype` has no single reduction to apply to."""
    if comm_dtype is not None:
        raise ValueError(
            f"comm_dtype={comm_dtype!r} with shard_params={group} and a loss that calls "
            "collectives over jdp.AXIS: its gradients are reduced across the groups where each "
            "layer computes them, in the compute dtype; drop comm_dtype, or sync the model "
            "state after the step (model_state_sync='mean')")


def unsynced_model_state(leaf: str, how: str) -> ValueError:
    """`model_state_sync=None` with a model state that is not one value on every device."""
    return ValueError(
        f"model_state_sync=None: the new model state {leaf} {how}, but the state holds one "
        "value for all the devices: "
        "sync it in the model (e.g. nn.BatchNorm(axis_name=jdp.AXIS)), or pass "
        "model_state_sync='mean' to average it after each step")


def varying_axes(x: Any) -> frozenset:
    """The mesh axes over which `x` varies inside `jax.shard_map` (empty outside it, and
    where types are not checked). The aval's `manual_axis_type.varying` is shard_map's record
    of them (what its out_specs check reads); JAX has no function that returns it."""
    typed = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(typed, "varying", ()))


def same_model_state(new_ms: Any, field: str) -> None:
    """`model_state_sync=None` inside `shard_map`: no leaf of the new model state may vary
    over `jdp.AXIS` (said at trace time, by the value's type)."""
    for path, x in jax.tree_util.tree_flatten_with_path(new_ms)[0]:
        if _mesh.AXIS in varying_axes(x):
            raise unsynced_model_state(field + leaf_name(path).replace("<root>", ""),
                                       "is computed from each device's batch with no "
                                       "collective over jdp.AXIS, so it may vary by device")


def leaf_name(path) -> str:
    """A tree path as users write it (`['params']['w']`), or <root>."""
    return jax.tree_util.keystr(path) or "<root>"


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


def boolean_mask(mask: Any) -> None:
    """An evaluation's mask says which rows count: True or False, nothing in between."""
    if mask.dtype != jnp.bool_:
        raise TypeError(f"batch['mask'] has dtype {mask.dtype}: expected bool (True for the rows "
                        "that count); pass mask.astype(bool), or weights as a metric of your own")


def own_metric_names(metrics: dict, taken: tuple) -> None:
    """The loss's aux metrics may not use a name the step gives its own metrics: "loss" is
    the objective it differentiates, averaged over the devices, and a user's "loss" (say,
    the data term of a regularised objective) would silently replace it."""
    for name in taken:
        if name in metrics:
            raise ValueError(
                f"loss_fn's metrics hold {name!r}, the name of the step's own metric (the loss "
                "it differentiates, averaged over the devices), which they would replace: "
                f"rename yours (e.g. {name + '_term'!r}), or drop it: metrics[{name!r}] is "
                "the loss_fn's loss already")


def per_example(values: Any, b: int) -> None:
    """Eval metrics must be a dict of per-example values `[b]`, none named "count" (the
    example count's name in the totals)."""
    if not isinstance(values, dict):
        raise TypeError(f"metric_fn returned {type(values).__name__}: expected a dict of "
                        f"per-example values of shape [{b}]")
    if "count" in values:
        raise ValueError("metric_fn returned a metric named 'count', the name jdp.eval_step and "
                         "jdp.evaluate give the number of examples (it would be overwritten): "
                         "rename it, e.g. 'n_correct'")
    for k, v in values.items():
        if jnp.shape(v) != (b,):
            raise ValueError(f"metric_fn value {k!r} has shape {jnp.shape(v)}: expected "
                             f"per-example values of shape [{b}]; return e.g. (pred == label) "
                             f"per example, "
                             f"not its mean")
