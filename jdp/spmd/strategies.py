"""One strategy per way the state is stored over the devices, behind one interface.

A train step is two halves, whatever the storage: `gradients(state, batch, stop)` gives
`(grads, new_model_state, metrics)` as global arrays, the gradients reduced over every device
and stored as `update` takes them; `update(state, grads, new_model_state)` applies them with
the optimizer and puts the model state (BatchNorm statistics) in its field. `of(options,
group)` picks the strategy:

| strategy     | the state at rest                      | gradients                             |
| ------------ | -------------------------------------- | ------------------------------------- |
| `Replicated` | whole on every device                  | per device in `shard_map`, all-reduced |
| `Zero`       | optimizer state split                  | per device, reduce-scattered          |
| `Fsdp`       | parameters and optimizer state split   | the devices' losses under one `vmap`  |
| `Hsdp`       | split within groups, copies across     | per group, summed across groups once  |

Every strategy takes each device's gradient through the same accumulation loop
(`grads.accumulate`) and calls the loss the same way (`grads._call_loss`). `options` is the
step's options object (`jdp.core`'s `StepOptions`): the loss and its form, `accum_steps`,
`model_state_sync`, `mean`, `comm_dtype`, `compute_dtype`, `cast_batch`.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jdp.job import values
from jdp.spmd import grads as _grads
from jdp.spmd import mesh as _mesh
from jdp.spmd import outputs as _outputs
from jdp.spmd import storage as _storage
from jdp.spmd.mesh import AXIS


def reduce_gradients(grads: Any, axis_name: str = AXIS, mean: bool = True,
                     comm_dtype: Any = None) -> Any:
    """All-reduce a gradient pytree across devices; call inside `jax.pmap` or `shard_map`.

    DDP's gradient all-reduce as a function (MindSpore's `DistributedGradReducer`), the one
    `jdp.train_step` uses, for hand-written steps. The whole tree goes in one collective.

    Args:
        grads: pytree of per-device gradients.
        axis_name: the mapped axis to reduce over; `jdp.AXIS` inside jdp's steps.
        mean: average (`lax.pmean`, DDP's default) if True, else sum (`lax.psum`).
        comm_dtype: send in this dtype (e.g. `jnp.bfloat16`, like DDP's bf16 compression
            hook) and cast back; the division for the mean happens after, at full precision.

    Returns:
        The reduced gradients, same structure and dtypes as `grads`.

    Raises:
        ValueError: a leaf of `grads` is typed as not varying over `axis_name` inside a
            `jax.shard_map` that checks types (`check_vma=True`, JAX's default): JAX's
            autodiff has already summed it over the devices (the gradient of parameters
            replicated over the axis), and reducing it again would give the sum, N times
            the mean. Mark the parameters varying first (`lax.pcast(params, axis_name,
            to="varying")`, as `jdp.train_step` does) or use `check_vma=False`.

    Example:
        >>> import jdp, numpy as np
        >>> reduce = jax.pmap(lambda g: jdp.reduce_gradients(g, axis_name="i"), axis_name="i")
        >>> n = jax.local_device_count()
        >>> float(reduce(np.arange(n, dtype=np.float32))[0]) == (n - 1) / 2
        True
    """
    mean = values.flag("jdp.reduce_gradients", "mean", mean)
    _not_summed_yet(grads, axis_name)
    if comm_dtype is None:
        return lax.pmean(grads, axis_name) if mean else lax.psum(grads, axis_name)
    dtypes = jax.tree.map(lambda g: g.dtype, grads)
    summed = lax.psum(jax.tree.map(lambda g: g.astype(comm_dtype), grads), axis_name)
    size = lax.psum(1, axis_name) if mean else 1
    return jax.tree.map(lambda g, d: g.astype(d) / size if mean else g.astype(d), summed, dtypes)


def _not_summed_yet(grads: Any, axis_name: str) -> None:
    """Refuse gradients that JAX's autodiff already summed over `axis_name` (see
    `reduce_gradients`), read from the values' types at trace time. Where types are not
    checked (`jax.pmap`, `shard_map(check_vma=False)`) even `lax.axis_index` does not vary,
    and nothing can be told: the caller's gradients are taken as per device."""
    if axis_name not in _outputs.varying_axes(lax.axis_index(axis_name)):
        return
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        if axis_name not in _outputs.varying_axes(g):
            raise ValueError(
                f"jdp.reduce_gradients: gradient {_outputs.leaf_name(path)} is already summed "
                f"over axis {axis_name!r} by JAX's autodiff (inside jax.shard_map with "
                "check_vma=True, JAX's default, the gradient of parameters replicated over the "
                "axis comes back summed over its devices, and a mean of that sum is N times "
                "too large): mark the parameters varying before taking the gradient, "
                f"params = lax.pcast(params, {axis_name!r}, to='varying'), or pass "
                "check_vma=False to jax.shard_map")


class Replicated:
    """Plain data parallelism: the state whole on every device; each device's gradient on
    its slice of the batch inside `jax.shard_map`, then one all-reduce; the update on the
    replicated state, identical everywhere."""

    def __init__(self, options: Any, group: int | None = None) -> None:
        self.options, self.group = options, group

    def gradients(self, state: Any, batch: Any, stop: Any) -> tuple:
        """`(grads, new_model_state, metrics)`, global; the metrics carry the stop flag."""
        master = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), p.dtype),
                              state.params)
        state_spec = jax.tree.map(lambda _: P(), state.replace(opt_state=None))
        return jax.shard_map(
            self.per_device, mesh=_mesh.mesh(), in_specs=(state_spec, P(AXIS), P(AXIS)),
            out_specs=(self.grad_specs(master), P(), P()))(
                state.replace(opt_state=None), self.batch(batch), stop)

    @property
    def per_device(self) -> Any:
        """One device's half, collectives over `AXIS` (also what `jdp.pmap` maps):
        `grads.device_grads` reducing with this strategy's `reduce`."""
        o = self.options
        return functools.partial(_grads.device_grads, reduce=self.reduce,
                                 compute_dtype=o.compute_dtype, **o.loss_options())

    def batch(self, batch: Any) -> Any:
        """The batch as the loss sees it: floating leaves in `compute_dtype` (`cast_batch`)."""
        o = self.options
        return _storage.cast(batch, o.compute_dtype) if o.cast_batch else batch

    def reduce(self, grads: Any) -> Any:
        return reduce_gradients(grads, mean=self.options.mean,
                                comm_dtype=self.options.comm_dtype)

    def grad_specs(self, master: Any) -> Any:
        del master
        return P()

    def update(self, state: Any, grads: Any, new_ms: Any) -> Any:
        """The optimizer update, then the new model state in its field."""
        state = self.apply(state, grads)
        field = _grads.model_state_field(state)
        return state.replace(**{field: new_ms}) if field else state

    def apply(self, state: Any, grads: Any) -> Any:
        return state.apply_gradients(grads=grads)


class Zero(Replicated):
    """ZeRO-1/2: the optimizer state split; each device's gradient reduce-scattered to its
    1/N, the update partitioned over the devices and the parameters all-gathered."""

    def reduce(self, grads: Any) -> Any:
        return _storage.scatter_gradients(grads, self.options.mean, self.options.comm_dtype)

    def grad_specs(self, master: Any) -> Any:
        return _storage.grad_specs(master)

    def apply(self, state: Any, grads: Any) -> Any:
        return _storage.apply(state, grads, self.options.comm_dtype)


class Fsdp(Replicated):
    """FSDP / ZeRO-3: parameters, gradients and optimizer state split; the devices' losses
    run under one `vmap` at jit level, so each parameter is gathered where it is used (layer
    by layer) and its gradient reduced and split again there (`grads.mapped_grads`)."""

    def gradients(self, state: Any, batch: Any, stop: Any) -> tuple:
        o = self.options
        return _grads.mapped_grads(
            state, self.batch(batch), stop, mean=o.mean, group=self.group,
            comm_dtype=o.comm_dtype, split_axes=_storage.split_axes(state.params, self.group),
            compute_dtype=o.compute_dtype, **o.loss_options())

    def apply(self, state: Any, grads: Any) -> Any:
        return _storage.apply(state, grads, self.options.comm_dtype, True, self.group)


class Hsdp(Fsdp):
    """HSDP: split as FSDP within groups of `group` consecutive devices, one copy per group;
    gathers and per-layer reductions stay in a group, and the gradient shards are summed
    across the groups once a step (`grads.mapped_grads` with `group`)."""


def of(options: Any, group: int | None = None) -> Replicated:
    """The strategy for a step's options; `group`: the devices one parameter is split over
    under `shard_params` (None: all of them)."""
    if options.shard_params:
        return Hsdp(options, group) if group else Fsdp(options)
    return Zero(options) if options.shard_optimizer else Replicated(options)
