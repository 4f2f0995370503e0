"""The parallel train and eval steps: a single-device step run on every device at once.

`train_step` turns `loss_fn(params, batch)` into a step over all local devices of all processes:
each device takes the gradient on its slice of the batch, one all-reduce (`lax.pmean`, or
`lax.psum`) combines them, and every device applies the same update. The parallel transform
lives in `_parallelize` alone, so another backend (jit + shard_map) can sit beside pmap.
"""
from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jdp import _checks, _mesh
from jdp._mesh import AXIS, mesh

_MODEL_STATE_FIELDS = ("model_state", "batch_stats")


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

    Example:
        >>> grads = jdp.reduce_gradients(jax.grad(loss)(params, batch), axis_name="i")
    """
    if comm_dtype is None:
        return lax.pmean(grads, axis_name) if mean else lax.psum(grads, axis_name)
    dtypes = jax.tree.map(lambda g: g.dtype, grads)
    summed = lax.psum(jax.tree.map(lambda g: g.astype(comm_dtype), grads), axis_name)
    size = lax.psum(1, axis_name) if mean else 1
    return jax.tree.map(lambda g, d: g.astype(d) / size if mean else g.astype(d), summed, dtypes)


def _model_state_field(state: Any) -> str | None:
    """Which field of `state` holds the model state (BatchNorm statistics), if any."""
    for name in _MODEL_STATE_FIELDS:
        if getattr(state, name, None) is not None:
            return name
    return None


def _device_rng(state: Any, micro: Any = None) -> Any:
    """This device's key for this step (and micro-batch): fold step and device index in."""
    key = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), lax.axis_index(AXIS))
    return key if micro is None else jax.random.fold_in(key, micro)


def _call_loss(loss_fn, has_aux, params, batch, model_state, rng):
    """Call the user's loss in its documented form; return (loss, (metrics, model_state))."""
    args = (params, batch) if model_state is None else (params, batch, model_state)
    out = loss_fn(*args, rng=rng) if rng is not None else loss_fn(*args)
    if model_state is None:
        loss, metrics = out if has_aux else (out, {})
        new_model_state = None
    elif has_aux:
        loss, (metrics, new_model_state) = out
    else:
        (loss, new_model_state), metrics = out, {}
    _checks.scalar_loss(loss)
    metrics = metrics if isinstance(metrics, dict) else {"aux": metrics}
    return loss, (metrics, new_model_state)


def _grads_once(loss_fn, has_aux, params, batch, model_state, rng):
    """Loss, metrics, gradient and new model state on one (micro-)batch."""
    grad_fn = jax.value_and_grad(
        lambda p: _call_loss(loss_fn, has_aux, p, batch, model_state, rng), has_aux=True)
    (loss, (metrics, new_ms)), grads = grad_fn(params)
    return loss, metrics, grads, new_ms


def _accumulated_grads(loss_fn, has_aux, k, state, batch, model_state):
    """Mean gradient over k micro-batches, local to the device: no communication in the loop.

    The model state threads through the micro-batches in order, as k forward passes would
    update it under DDP's `no_sync`.
    """
    use_rng = getattr(state, "rng", None) is not None
    if k == 1:
        rng = _device_rng(state) if use_rng else None
        return _grads_once(loss_fn, has_aux, state.params, batch, model_state, rng)
    micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)

    def body(carry, xs):
        grad_sum, ms = carry
        mb, i = xs
        rng = _device_rng(state, i) if use_rng else None
        loss, metrics, grads, ms = _grads_once(loss_fn, has_aux, state.params, mb, ms, rng)
        return (jax.tree.map(jnp.add, grad_sum, grads), ms), (loss, metrics)

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    (grad_sum, model_state), (losses, metrics) = lax.scan(
        body, (zeros, model_state), (micro, jnp.arange(k)))
    grads = jax.tree.map(lambda g: g / k, grad_sum)
    return losses.mean(), jax.tree.map(lambda m: m.mean(0), metrics), grads, model_state


def _sync_model_state(model_state: Any, how: str | None) -> Any:
    """Average floating-point model state over devices (`how="mean"`), else leave it."""
    if how is None:
        return model_state
    return jax.tree.map(
        lambda x: lax.pmean(x, AXIS) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        model_state)


def _device_train_step(state, batch, *, loss_fn, has_aux, grad_reduce, accum_steps,
                       model_state_sync, comm_dtype):
    """What one device does in one step; collectives run over `AXIS`."""
    field = _model_state_field(state)
    model_state = getattr(state, field) if field else None
    loss, metrics, grads, new_ms = _accumulated_grads(
        loss_fn, has_aux, accum_steps, state, batch, model_state)
    grads = reduce_gradients(grads, mean=grad_reduce == "mean", comm_dtype=comm_dtype)
    state = state.apply_gradients(grads=grads)
    if field:
        state = state.replace(**{field: _sync_model_state(new_ms, model_state_sync)})
    metrics = {"loss": loss, **metrics}
    metrics = lax.pmean(jax.tree.map(lambda m: jnp.asarray(m, jnp.float32), metrics), AXIS)
    return state, metrics


def _parallelize(fn: Callable, donate_state: bool, backend: str) -> Callable:
    """The parallel transform: `fn(state, batch)` on every local device, its collectives
    spanning all devices of all processes. The only place that knows the backend.

    "pmap": `jax.pmap`, whose axis covers the global device set. "shard_map": `jax.jit` of
    `jax.shard_map` over one global mesh (JAX's recommended path since pmap entered maintenance
    mode); the process-local arrays are regrouped into global ones and back, without copies.
    Both take and return the same `[local_devices, ...]` arrays.
    """
    _checks.backend(backend)
    donate = (0,) if donate_state else ()
    if backend == "pmap":
        return jax.pmap(fn, axis_name=AXIS, donate_argnums=donate)
    sharding = _mesh.global_sharding()
    spec = sharding.spec

    def per_block(state, batch):  # each device's block keeps a leading axis of 1
        out = fn(*jax.tree.map(lambda x: x[0], (state, batch)))
        return jax.tree.map(lambda x: x[None], out)

    mapped = jax.jit(jax.shard_map(per_block, mesh=sharding.mesh,
                                   in_specs=(spec, spec), out_specs=spec),
                     donate_argnums=donate)

    def call(state, batch):
        return _mesh.to_local(mapped(*_mesh.to_global((state, batch))))

    call.lower = lambda state, batch: mapped.lower(*_mesh.to_global((state, batch)))
    return call


class _Bounded:
    """Wait on the oldest step's outputs once more than `limit` steps are in flight.

    Many queued multi-device all-reduces can stall XLA's CPU rendezvous and abort the process
    (RELIABILITY_NOTES); a couple of steps of look-ahead keep the devices busy all the same.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.pending: collections.deque = collections.deque()

    def add(self, outputs: Any) -> None:
        self.pending.append(outputs)
        while len(self.pending) > self.limit:
            jax.block_until_ready(self.pending.popleft())


def train_step(loss_fn: Callable, *, has_aux: bool = False, grad_reduce: str = "mean",
               accum_steps: int = 1, model_state_sync: str | None = "mean",
               comm_dtype: Any = None, donate: bool = True,
               max_in_flight: int = 2, backend: str = "pmap") -> Callable:
    """Make a data-parallel train step from a pure single-device loss.

    `step(state, batch)` runs `loss_fn` on every local device's slice of `batch`, all-reduces
    the gradients over all devices of all processes in one collective, and applies the
    optimiser (`state.apply_gradients`) identically everywhere, so N devices with b examples
    each train exactly as one device on the N·b batch. The loss is called as:

    | model state¹ | has_aux | call and return                                          |
    | no           | False   | `loss_fn(params, batch) -> loss`                         |
    | no           | True    | `loss_fn(params, batch) -> (loss, metrics)`              |
    | yes          | False   | `loss_fn(params, batch, ms) -> (loss, new_ms)`           |
    | yes          | True    | `loss_fn(params, batch, ms) -> (loss, (metrics, new_ms))` |

    ¹ a non-None `model_state` (jdp.TrainState) or `batch_stats` field. If the state has a
    non-None `rng`, the loss also gets `rng=`: a key distinct per device, step and micro-batch.

    Args:
        loss_fn: pure function of one device's data; returns a scalar loss (mean over examples).
        has_aux: the loss also returns a dict of metrics, averaged over devices.
        grad_reduce: "mean" (DDP) or "sum" (MindSpore's `gradients_mean=False`).
        accum_steps: split each device's batch into k micro-batches, sum their gradients
            locally and all-reduce once (DDP's `no_sync`); equals one step on the whole batch.
        model_state_sync: "mean" averages model state (BatchNorm statistics) over devices after
            each step; None leaves each device its own. For SyncBatchNorm instead, build the
            model with `nn.BatchNorm(axis_name=jdp.AXIS)`.
        comm_dtype: dtype for the gradient all-reduce (e.g. `jnp.bfloat16`); None: as is.
        donate: donate the input state's buffers to the output (the old state is consumed).
        max_in_flight: steps dispatched ahead before waiting; bounds host run-ahead.
        backend: "pmap" (default) or "shard_map" (`jit` + `shard_map` on a global mesh); the
            same call, arrays and results either way.

    Returns:
        `step(state, batch) -> (state, metrics)`; `state` replicated (`jdp.replicate`), batch
        leaves `[local_devices, per_device_batch, ...]`; metrics (with "loss") replicated.
        `step.lower(state, batch)` gives the lowered computation, for inspection.

    Example:
        >>> def loss_fn(params, batch):
        ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
        >>> step = jdp.train_step(loss_fn)
        >>> state, metrics = step(jdp.replicate(state), jdp.shard({"x": x, "y": y}))
    """
    _checks.train_options(grad_reduce, accum_steps, model_state_sync, max_in_flight)
    device_step = functools.partial(
        _device_train_step, loss_fn=loss_fn, has_aux=has_aux, grad_reduce=grad_reduce,
        accum_steps=accum_steps, model_state_sync=model_state_sync, comm_dtype=comm_dtype)
    return _make_step(device_step, donate, max_in_flight, backend, accum_steps,
                      wait_on=lambda out: out[1])


def _make_step(device_fn: Callable, donate: bool, max_in_flight: int, backend: str,
               accum_steps: int = 1, wait_on: Callable = lambda out: out) -> Callable:
    """Wrap a per-device step: check inputs once per signature, run it, bound run-ahead."""
    parallel = _parallelize(device_fn, donate, backend)
    checked: set = set()
    in_flight = _Bounded(max_in_flight)

    @functools.wraps(device_fn)
    def step(state, batch):
        n = jax.local_device_count()
        _checks.batch(batch, n, accum_steps)
        signature = _checks.signature(state, batch)
        if signature not in checked:
            _checks.replicated_state(state, n)
            _checks.trace_per_device(device_fn, state, batch)
            checked.add(signature)
        out = parallel(state, batch)
        in_flight.add(wait_on(out))
        return out

    step.lower = parallel.lower
    return step


def _device_eval_step(state, batch, *, metric_fn):
    """Mask-weighted sums of per-example metrics over all devices, plus the example count."""
    values = metric_fn(state, batch)
    first = jax.tree.leaves(batch)[0]
    mask = batch["mask"] if isinstance(batch, dict) and "mask" in batch else jnp.ones(
        first.shape[0], bool)
    _checks.per_example(values, mask.shape[0])
    sums = {k: jnp.sum(jnp.where(mask, v, 0), dtype=jnp.float32) for k, v in values.items()}
    sums["count"] = jnp.sum(mask, dtype=jnp.float32)
    return lax.psum(sums, AXIS)


def eval_step(metric_fn: Callable, *, max_in_flight: int = 2,
              backend: str = "pmap") -> Callable:
    """Make a data-parallel evaluation that is exact over padded batches.

    `metric_fn(state, batch)` runs on one device's slice and returns a dict of per-example
    values of shape `[per_device_batch]`. The step sums each over the real examples of all
    devices of all processes (`batch["mask"]` False rows count for nothing) and adds "count",
    so `sum / count` is the exact mean over the split however it was padded.

    Args:
        metric_fn: `metric_fn(state, batch) -> {name: per-example values [per_device_batch]}`.
        max_in_flight: evaluations dispatched ahead before waiting.
        backend: "pmap" or "shard_map", as in `train_step`.

    Returns:
        `evaluate(state, batch) -> totals`, replicated like the state.

    Example:
        >>> def metric_fn(state, batch):
        ...     logits = state.apply_fn({"params": state.params}, batch["image"])
        ...     return {"correct": (logits.argmax(-1) == batch["label"]).astype(jnp.float32)}
        >>> totals = jdp.unreplicate(jdp.eval_step(metric_fn)(state, batch))
        >>> accuracy = float(totals["correct"]) / float(totals["count"])
    """
    device_step = functools.partial(_device_eval_step, metric_fn=metric_fn)
    return _make_step(device_step, donate=False, max_in_flight=max_in_flight, backend=backend)
