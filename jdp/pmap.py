"""The classic pmap form: state stacked `[local_devices, ...]`, the step a real `jax.pmap`.

Every leaf of a stacked state carries one copy per local device; batches are
`[local_devices, per_device, ...]`; metrics come back stacked (`unreplicate` takes device 0's
copy). The step maps the same per-device function as the global core (`jdp.train_step`), with
the same options except ZeRO, so both train identically. This module is the one place in jdp
that knows the stacked layout; it registers it with `jdp.core.layouts` when imported, and so
layout-blind code (`jdp.shard(rows, layout="pmap")`, the Loader, the Checkpointer) finds
`place_rows`, `to_global` and `like` there without importing this module. Every array it
makes, its steps' outputs included, is placed with `local_sharding()`, whose axis name marks
the form (`jdp.core.forms`): a shape never does.

Example:
    >>> import jdp, optax
    >>> def loss_fn(params, batch):
    ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> state = jdp.pmap.replicate(jdp.TrainState.create(
    ...     apply_fn=None, params={"w": np.zeros((2, 1))}, tx=optax.sgd(0.1)))
    >>> n = jax.local_device_count()
    >>> batch = jdp.pmap.shard({"x": np.ones((n, 2)), "y": np.ones((n, 1))})
    >>> state, metrics = jdp.pmap.train_step(loss_fn)(state, batch)
    >>> float(jdp.pmap.unreplicate(metrics)["loss"])
    1.0
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp.core import (
    AXIS,
    Step,
    StepOptions,
    batch_leaves,
    bool_options,
    device_eval_step,
    device_train_step,
    divisible_rows,
    forms,
    layouts,
    leaf_name,
    one_size,
    place,
    prng_keys,
    replicated,
    stop_values,
    train_options,
    trainable,
)
from jdp.core.forms import LOCAL_AXIS
from jdp.distributed import broadcast_for


def local_sharding(devices: Sequence[jax.Device] | None = None) -> NamedSharding:
    """Slice i of an array's leading axis on device i of `devices` (default: pmap's order,
    `jax.local_devices()`, so placed arrays enter the pmapped step without a copy)."""
    devices = jax.local_devices() if devices is None else list(devices)
    return NamedSharding(Mesh(np.array(devices), (LOCAL_AXIS,)), PartitionSpec(LOCAL_AXIS))


def replicate(tree: Any) -> Any:
    """One copy of every leaf of `tree` on each local device: leaves `[local_devices, ...]`.

    On several processes every process ends up with process 0's values, so replicas start
    identical even if processes were seeded differently.

    Example:
        >>> import jdp
        >>> jdp.pmap.replicate({"w": np.ones(3)})["w"].shape == (jax.local_device_count(), 3)
        True
    """
    if is_stacked(tree, "jdp.pmap.replicate"):
        raise ValueError("jdp.pmap.replicate: the tree is already in the pmap form (every leaf one "
                         "copy per local device): pass it to the step as it is, or "
                         "jdp.pmap.unreplicate(tree) first")
    sharding = local_sharding()
    n = len(sharding.device_set)
    tree, keys = prng_keys.unwrap(tree)   # typed PRNG keys travel as their key data
    host = broadcast_for(tree, "jdp.pmap.replicate")
    return prng_keys.wrap(jax.tree.map(
        lambda x: jax.device_put(np.broadcast_to(x, (n, *np.shape(x))), sharding), host), keys)


def unreplicate(tree: Any) -> Any:
    """Device 0's copy of a stacked tree (a state, or a step's metrics); global arrays (on
    `jdp.mesh()`, whatever their shape) come back unchanged, so code for both forms can call it.

    The form is known from where jdp.pmap placed an array, never from its shape; an array split
    one row per local device on a mesh that is not jdp's (your own `jax.pmap`'s output) is
    taken as stacked, since this call says it is.

    Raises:
        ValueError: a host (numpy) leaf or a number: its form cannot be told.

    Example:
        >>> import jdp
        >>> jdp.pmap.unreplicate(jdp.pmap.replicate({"w": np.ones(3)}))["w"].shape
        (3,)
    """
    def first(path, x):
        if not isinstance(x, jax.Array):
            raise ValueError(
                f"jdp.unreplicate: leaf {leaf_name(path)} has shape {np.shape(x)} on the "
                "host: it is not replicated (a host array's form cannot be told from its "
                "shape). Pass what jdp.pmap.replicate or a pmap step returned, before "
                "jax.device_get, or use the value as is")
        if forms.leaf_form(x) == forms.GLOBAL:
            return x
        return x.addressable_data(0)[0]

    return jax.tree_util.tree_map_with_path(first, tree)


def shard(rows: Any) -> Any:
    """This process's rows `[n*b, ...]` split over its `n` local devices: `[n, b, ...]`.

    Example:
        >>> import jdp
        >>> n = jax.local_device_count()
        >>> jdp.pmap.shard({"x": np.zeros((2 * n, 3))})["x"].shape == (n, 2, 3)
        True
    """
    return place_rows(divisible_rows(rows, "jdp.pmap.shard"))


def place_rows(rows: Any, devices: Sequence[jax.Device] | None = None) -> Any:
    """`shard` onto `devices` (default: the local devices), without the checks: the Loader's
    placement for `layout="pmap"`."""
    sharding = local_sharding(devices)
    n = len(sharding.device_set)
    return jax.device_put(jax.tree.map(
        lambda x: np.asarray(x).reshape(n, -1, *np.shape(x)[1:]), rows), sharding)


def train_step(loss_fn: Callable, *, has_aux: bool = False, grad_reduce: str = "mean",
               accum_steps: int = 1, model_state_sync: str | None = "mean",
               comm_dtype: Any = None, donate: bool = True,
               max_in_flight: int = 2) -> Step:
    """`jdp.train_step` in the pmap form: a real `jax.pmap` over the local devices.

    The state comes from `replicate`, batches are `[local_devices, per_device, ...]` (`shard`,
    or `jdp.data.Loader(..., layout="pmap")`), and the metrics come back stacked. The options
    mean what they mean for `jdp.train_step`; `model_state_sync=None` leaves each device its
    own model state.
    """
    who = "jdp.pmap.train_step"
    o = {**train_options(grad_reduce, accum_steps, model_state_sync, max_in_flight, comm_dtype,
                         who=who),
         **bool_options(who, has_aux=has_aux, donate=donate)}
    body = functools.partial(device_train_step, options=StepOptions(
        loss_fn, has_aux=o["has_aux"], grad_reduce=o["grad_reduce"],
        accum_steps=o["accum_steps"], model_state_sync=o["model_state_sync"],
        comm_dtype=comm_dtype, donate=o["donate"], max_in_flight=o["max_in_flight"]))
    transform = functools.partial(_MarkedPmap, axis_name=AXIS,
                                  donate_argnums=(0,) if o["donate"] else ())
    check = functools.partial(_check, accum_steps=o["accum_steps"], train=True)
    return Step(body, check, transform, _place_stop, max_in_flight=o["max_in_flight"],
                train=True, donate=o["donate"])


def eval_step(metric_fn: Callable, *, max_in_flight: int = 2) -> Step:
    """`jdp.eval_step` in the pmap form: totals come back stacked (every copy the same)."""
    max_in_flight = train_options("mean", 1, "mean", max_in_flight,
                                  who="jdp.pmap.eval_step")["max_in_flight"]
    body = functools.partial(device_eval_step, metric_fn=metric_fn)
    return Step(body, functools.partial(_check, accum_steps=1),
                functools.partial(_MarkedPmap, axis_name=AXIS), _place_stop,
                max_in_flight=max_in_flight, train=False)


class _MarkedPmap:
    """`jax.pmap(fn, **options)` whose outputs carry the pmap form's mark (`local_sharding()`):
    jax.pmap gives them the sharding of a global batch on jdp's own axis name. The buffers
    are rewrapped, not copied."""

    def __init__(self, fn: Callable, **options: Any) -> None:
        self._pmapped = jax.pmap(fn, **options)
        self.lower = self._pmapped.lower

    def __call__(self, *args: Any) -> tuple:
        out, done = self._pmapped(*args)
        return mark(out), done


def mark(tree: Any) -> Any:
    """`tree`'s stacked arrays (one row per local device) under `local_sharding()`, zero-copy."""
    sharding = local_sharding()

    def rewrap(x):
        if not isinstance(x, jax.Array) or x.sharding == sharding:
            return x
        return jax.make_array_from_single_device_arrays(
            x.shape, sharding, [s.data for s in x.addressable_shards])

    return jax.tree.map(rewrap, tree)


def _place_stop(flag: bool) -> jax.Array:
    return place_rows(stop_values(flag, jax.local_device_count()))


def _check(state: Any, batch: Any, *, accum_steps: int, train: bool = False) -> None:
    """A stacked state (one copy per local device) and batches `[n, per_device, ...]`."""
    if train:
        trainable(getattr(state, "params", None))
    n = jax.local_device_count()
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if forms.leaf_form(x) == forms.GLOBAL:
            raise ValueError(
                f"state leaf {leaf_name(path)} is {_where(x)}: jdp.pmap steps take one copy "
                f"per local device (leading axis {n}); pass the state through "
                "jdp.pmap.replicate(state) first (a state from jdp.broadcast goes with "
                "jdp.train_step)")
    _check_batch(batch, n, accum_steps)


def _check_batch(batch: Any, n: int, accum_steps: int) -> None:
    leaves = batch_leaves(batch)
    for path, x in leaves:
        if len(jnp.shape(x)) < 2 or jnp.shape(x)[0] != n:
            raise ValueError(
                f"batch leaf {leaf_name(path)} has shape {jnp.shape(x)}: expected [{n}, "
                f"per_device_batch, ...] with a leading axis of {n} local devices; split it "
                "with jdp.pmap.shard(rows) or feed it through jdp.data.Loader(..., "
                "layout='pmap')")
    if one_size(leaves, 1, " per device") % accum_steps:
        raise ValueError(f"per-device batch {jnp.shape(leaves[0][1])[1]} is not divisible by "
                         f"accum_steps={accum_steps}: pick a batch size that is a multiple of "
                         f"{accum_steps} x {n} devices")


def _where(x: Any) -> str:
    if isinstance(x, jax.Array) and x.ndim and len(x.sharding.device_set) == 1:
        return "on one device"
    if isinstance(x, jax.Array) and x.ndim:
        return f"a global array of shape {x.shape} (not placed by jdp.pmap)"
    return f"of shape {jnp.shape(x)}"


def is_stacked(tree: Any, who: str = "jdp.pmap") -> bool:
    """Whether `tree` is in the pmap form (placed by jdp.pmap: `jdp.core.forms`); a tree that
    could be either form, or mixes both, is a ValueError naming the leaf."""
    return forms.tree_form(tree, who) == forms.PMAP


def to_global(tree: Any, who: str = "jdp.pmap.to_global") -> Any:
    """One copy of a stacked tree as global arrays replicated on `jdp.mesh()`; any other tree
    unchanged."""
    if not is_stacked(tree, who):
        return tree
    one, keys = prng_keys.unwrap(unreplicate(tree))
    one = jax.device_get(one)
    return prng_keys.wrap(jax.tree.map(lambda x: place(x, replicated()), one), keys)


def like(template: Any, tree: Any, who: str = "jdp.pmap.like") -> Any:
    """`tree` in `template`'s form: stacked if the template is, else unchanged."""
    return replicate(tree) if is_stacked(template, who) else tree


layouts.register(layouts.Layout(
    name="pmap", holds=is_stacked, shard=shard, place_rows=place_rows, to_global=to_global,
    like=like, made_by="jdp.replicate", undone_by="jdp.pmap.unreplicate",
    step="jdp.pmap.train_step"))
