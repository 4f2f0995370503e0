"""The parallel train and eval steps: a single-device step run on every device at once.

`train_step` turns `loss_fn(params, batch)` into a step over all devices of all processes:
each device takes the gradient on its slice of the batch, one all-reduce (`lax.pmean`, or
`lax.psum`) combines them, and every device applies the same update. The same step takes both
layouts of `jdp.state`: a global state (`jdp.broadcast`) and global batches run through
`jax.jit` of `jax.shard_map` over `jdp.mesh()`; a stacked state (`jdp.replicate`) and
`[local_devices, ...]` batches through `jax.pmap`. The per-device work (`jdp._grads`) is the same.
"""
from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jdp.launch import _progress
from jdp.core import _checks, _grads, _mesh, _zero
from jdp.core import _state
from jdp.core._mesh import AXIS


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
        >>> reduce = jax.pmap(lambda g: jdp.reduce_gradients(g, axis_name="i"), axis_name="i")
        >>> n = jax.local_device_count()
        >>> float(reduce(np.arange(n, dtype=np.float32))[0]) == (n - 1) / 2
        True
    """
    if comm_dtype is None:
        return lax.pmean(grads, axis_name) if mean else lax.psum(grads, axis_name)
    dtypes = jax.tree.map(lambda g: g.dtype, grads)
    summed = lax.psum(jax.tree.map(lambda g: g.astype(comm_dtype), grads), axis_name)
    size = lax.psum(1, axis_name) if mean else 1
    return jax.tree.map(lambda g, d: g.astype(d) / size if mean else g.astype(d), summed, dtypes)


def _device_train_step(state, batch, stop, *, grad_reduce, comm_dtype, **options):
    """What one device does in one step; collectives run over `AXIS`."""
    grads, field, new_ms, metrics = _grads.device_grads(state, batch, stop, **options)
    grads = reduce_gradients(grads, mean=grad_reduce == "mean", comm_dtype=comm_dtype)
    state = state.apply_gradients(grads=grads)
    if field:
        state = state.replace(**{field: new_ms})
    return state, metrics


def _global_train_step(state, batch, stop, *, grad_reduce, comm_dtype, shard_optimizer,
                       **options):
    """The global layout's step (jit level): gradients per device inside `shard_map`, reduced
    there, then the optimiser update on global arrays outside it.

    Outside `shard_map` the compiler updates the replicated state without a manual region in
    the way (the example CNN's global/pmap step ratio went from 0.96 to 1.01 when the update
    moved out), and with `shard_optimizer` it partitions the update over the devices
    (`jdp/_zero.py`).
    """
    mean = grad_reduce == "mean"

    def per_device(state, batch, stop):
        grads, _, new_ms, metrics = _grads.device_grads(state, batch, stop, **options)
        if shard_optimizer:
            return _zero.scatter_gradients(grads, mean, comm_dtype), new_ms, metrics
        return reduce_gradients(grads, mean=mean, comm_dtype=comm_dtype), new_ms, metrics

    grad_spec = _zero.grad_specs(state.params) if shard_optimizer else P()
    grads, new_ms, metrics = jax.shard_map(
        per_device, mesh=_mesh.mesh(), in_specs=(P(), P(AXIS), P(AXIS)),
        out_specs=(grad_spec, P(), P()))(state.replace(opt_state=None), batch, stop)
    if shard_optimizer:
        state = _zero.apply(state, grads, comm_dtype)
    else:
        state = state.apply_gradients(grads=grads)
    field = _grads.model_state_field(state)
    return (state.replace(**{field: new_ms}) if field else state), metrics


def _transform(fn: Callable, layout: str, donate: bool, backend: str,
               whole: bool = False) -> Callable:
    """The parallel transform: `fn(state, batch, stop)` on every device, its collectives
    spanning all devices of all processes. The only place that knows layouts and backends.

    Global layout: `jax.jit` of `jax.shard_map` over `jdp.mesh()` (state replicated, batch and
    stop split along `AXIS`); with `whole`, `fn` is already the jit-level step (the train
    step) and places its own shard_map. Stacked layout: `jax.pmap`, or with
    `backend="shard_map"` the same shard_map on the stacked arrays viewed as global ones.
    """
    donate_argnums = (0,) if donate else ()
    if layout == _state.GLOBAL:
        mapped = fn if whole else jax.shard_map(
            fn, mesh=_mesh.mesh(), in_specs=(P(), P(AXIS), P(AXIS)), out_specs=P())
        return jax.jit(mapped, donate_argnums=donate_argnums)
    if backend == "pmap":
        return jax.pmap(fn, axis_name=AXIS, donate_argnums=donate_argnums)
    return _stacked_shard_map(fn, donate_argnums)


def _stacked_shard_map(fn: Callable, donate_argnums: tuple) -> Callable:
    """Stacked `[local_devices, ...]` arrays through jit + shard_map, viewed as global arrays."""
    from jax.experimental import multihost_utils

    def per_block(*args):  # each device's block keeps a leading axis of 1
        out = fn(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: x[None], out)

    mesh, spec = _mesh.mesh(), P(AXIS)
    mapped = jax.jit(jax.shard_map(per_block, mesh=mesh, in_specs=spec, out_specs=spec),
                     donate_argnums=donate_argnums)
    to_global = functools.partial(multihost_utils.host_local_array_to_global_array,
                                  global_mesh=mesh, pspecs=spec)

    def call(*args):
        if jax.process_count() == 1:
            return mapped(*args)
        out = mapped(*to_global(args))
        return multihost_utils.global_array_to_host_local_array(out, mesh, spec)

    call.lower = lambda *args: mapped.lower(*(to_global(args) if jax.process_count() > 1
                                              else args))
    return call


class _Bounded:
    """Wait on the oldest step's outputs once more than `limit` steps are in flight.

    Hundreds of queued multi-device all-reduces can stall XLA's CPU rendezvous and abort the
    process; a couple of steps of look-ahead keep the devices busy all the same. Every rank
    waits on the same step at the same call, so what it reads there (the agreed stop flag)
    is the same on every rank.
    """

    def __init__(self, limit: int, on_done: Callable[[Any], None] | None = None):
        self.limit, self.on_done = limit, on_done
        self.pending: collections.deque = collections.deque()

    def add(self, outputs: Any) -> None:
        self.pending.append(outputs)
        while len(self.pending) > self.limit:
            done = jax.block_until_ready(self.pending.popleft())
            if self.on_done is not None:
                self.on_done(done)


def _agreed_stop(metrics: dict) -> None:
    """Tell `jdp.preempted()` what every rank computed for a finished step."""
    flag = metrics[_grads.STOP]
    _progress.set_agreed(float(np.asarray(flag.addressable_data(0)).reshape(-1)[0]) > 0)


def train_step(loss_fn: Callable, *, has_aux: bool = False, grad_reduce: str = "mean",
               accum_steps: int = 1, model_state_sync: str | None = "mean",
               comm_dtype: Any = None, donate: bool = True, max_in_flight: int = 2,
               backend: str = "pmap", shard_optimizer: bool = False) -> Callable:
    """Make a data-parallel train step from a pure single-device loss.

    `step(state, batch)` runs `loss_fn` on every device's slice of `batch`, all-reduces the
    gradients over all devices of all processes in one collective, and applies the optimiser
    (`state.apply_gradients`) identically everywhere, so N devices with b examples each train
    exactly as one device on the N·b batch. The loss is called as:

    | model state¹ | has_aux | call and return                                          |
    | no           | False   | `loss_fn(params, batch) -> loss`                         |
    | no           | True    | `loss_fn(params, batch) -> (loss, metrics)`              |
    | yes          | False   | `loss_fn(params, batch, ms) -> (loss, new_ms)`           |
    | yes          | True    | `loss_fn(params, batch, ms) -> (loss, (metrics, new_ms))` |

    ¹ a non-None `model_state` (jdp.TrainState) or `batch_stats` field. If the state has a
    non-None `rng`, the loss also gets `rng=`: a key distinct per device, step and micro-batch.

    Both layouts: a global state (`jdp.broadcast`) with global batches (`Loader(...,
    layout="global")`, `jdp.shard(b, layout="global")`) runs as `jit(shard_map)` and returns
    replicated scalar metrics; a stacked state (`jdp.replicate`) with `[local_devices, b, ...]`
    batches runs as `pmap` and returns stacked metrics.

    Args:
        loss_fn: pure function of one device's data; returns a scalar loss (mean over examples).
        has_aux: the loss also returns a dict of metrics, averaged over devices.
        grad_reduce: "mean" (DDP) or "sum" (MindSpore's `gradients_mean=False`).
        accum_steps: split each device's batch into k micro-batches, sum their gradients
            locally and all-reduce once (DDP's `no_sync`); equals one step on the whole batch.
        model_state_sync: "mean" averages model state (BatchNorm statistics) over devices after
            each step; None leaves each device its own (stacked layout only, or SyncBatchNorm:
            `nn.BatchNorm(axis_name=jdp.AXIS)`, whose statistics agree by construction).
        comm_dtype: dtype for the gradient communication (e.g. `jnp.bfloat16`); None: as is.
        donate: donate the input state's buffers to the output (the old state is consumed).
        max_in_flight: steps dispatched ahead before waiting (1..32); bounds host run-ahead.
        backend: stacked layout only: "pmap" (default) or "shard_map" (the same step through
            jit + shard_map); the global layout is always jit + shard_map.
        shard_optimizer: ZeRO-1/2 (global layout, state from `jdp.broadcast(state,
            shard_optimizer=True)`): gradients reduce-scattered, each device updates its 1/N
            of the optimiser state, the updates all-gathered.

    Returns:
        `step(state, batch) -> (state, metrics)`, metrics with "loss" (and the aux metrics),
        averaged over devices. `step.lower(state, batch)` gives the lowered computation.

    Example:
        >>> import optax
        >>> def loss_fn(params, batch):
        ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
        >>> state = jdp.broadcast(jdp.TrainState.create(
        ...     apply_fn=None, params={"w": np.zeros((2, 1))}, tx=optax.sgd(0.1)))
        >>> n = jax.device_count()
        >>> batch = jdp.shard({"x": np.ones((n, 2)), "y": np.ones((n, 1))}, layout="global")
        >>> state, metrics = jdp.train_step(loss_fn)(state, batch)
        >>> float(metrics["loss"])
        1.0
    """
    _checks.train_options(grad_reduce, accum_steps, model_state_sync, max_in_flight)
    _checks.backend(backend)
    options = dict(loss_fn=loss_fn, has_aux=has_aux, grad_reduce=grad_reduce,
                   accum_steps=accum_steps, model_state_sync=model_state_sync,
                   comm_dtype=comm_dtype)
    device_step = functools.partial(_device_train_step, **options)
    global_step = functools.partial(_global_train_step, shard_optimizer=shard_optimizer,
                                    **options)
    return _make_step(device_step, donate, max_in_flight, backend, accum_steps,
                      global_step=global_step, shard_optimizer=shard_optimizer,
                      on_done=_agreed_stop,
                      phase="step")


def _make_step(device_fn: Callable, donate: bool, max_in_flight: int, backend: str,
               accum_steps: int = 1, global_step: Callable | None = None,
               shard_optimizer: bool = False,
               on_done: Callable | None = None, phase: str = "eval") -> Callable:
    """Wrap a per-device step: check inputs once per signature, run it in the state's layout,
    bound run-ahead, strip the stop flag from the metrics."""
    compiled: dict = {}
    checked: set = set()
    in_flight = _Bounded(max_in_flight, on_done)
    stops = _StopFlags()
    calls = [0]

    def parallel(layout):
        if layout not in compiled:
            _checks.layout_options(layout, shard_optimizer)
            whole = layout == _state.GLOBAL and global_step is not None
            compiled[layout] = _transform(global_step if whole else device_fn, layout, donate,
                                          backend, whole)
        return compiled[layout]

    @functools.wraps(device_fn)
    def step(state, batch):
        layout = _checks.state_layout(state)
        _checks.not_donated(state)
        _checks.batch(batch, layout, accum_steps)
        signature = _checks.signature(state, batch)
        if signature not in checked:
            _checks.state_in_layout(state, layout, shard_optimizer)
            _checks.trace(parallel(layout), state, batch, stops.get(layout, False))
            checked.add(signature)
        calls[0] += 1
        # Before dispatching: a rank blocked in step k shows step k. Evaluations count no steps.
        _progress.record(phase, calls[0] if phase == "step" else None)
        out = parallel(layout)(state, batch, stops.get(layout, _progress.stop_flag()))
        in_flight.add(out[1] if isinstance(out, tuple) else out)  # the state may be donated
        return _without_stop(out)

    step.lower = lambda state, batch: parallel(_checks.state_layout(state)).lower(
        state, batch, stops.get(_checks.state_layout(state), False))
    return step


def _without_stop(out: Any) -> Any:
    """The step's outputs as the user sees them: a train step's metrics without the internal
    stop flag (an evaluation's totals never carry one)."""
    if isinstance(out, tuple):
        return out[0], {k: v for k, v in out[1].items() if k != _grads.STOP}
    return out


class _StopFlags:
    """The per-device stop flag a step sends, placed once per layout and value (no per-step
    host-to-device work beyond handing over a cached array)."""

    def __init__(self):
        self.cache: dict = {}

    def get(self, layout: str, flag: bool) -> jax.Array:
        key = (layout, bool(flag))
        if key not in self.cache:
            local = np.full(jax.local_device_count(), float(flag), np.float32)
            self.cache[key] = _mesh.place_batch(local, layout)
        return self.cache[key]


def _device_eval_step(state, batch, stop, *, metric_fn):
    """Mask-weighted sums of per-example metrics over all devices, plus the example count."""
    del stop
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
        backend: stacked layout only, as in `train_step`.

    Returns:
        `evaluate(state, batch) -> totals`: replicated scalars for a global state, stacked
        for a stacked one.

    Example:
        >>> def metric_fn(state, batch):
        ...     return {"sq": (batch["x"] * state["w"]) ** 2}
        >>> n = jax.device_count()
        >>> batch = jdp.shard({"x": np.ones(n), "mask": np.arange(n) < n - 1}, layout="global")
        >>> totals = jdp.eval_step(metric_fn)(jdp.broadcast({"w": np.float32(2)}), batch)
        >>> float(totals["sq"]) / float(totals["count"])
        4.0
    """
    _checks.train_options("mean", 1, "mean", max_in_flight)
    _checks.backend(backend)
    device_step = functools.partial(_device_eval_step, metric_fn=metric_fn)
    return _make_step(device_step, donate=False, max_in_flight=max_in_flight, backend=backend)
