"""The data-parallel train and eval steps on global arrays: one device's step on every device.

`train_step` turns `loss_fn(params, batch)` into a step over all devices of all processes:
the step object checks, agrees and dispatches; what it computes is the two halves of the
storage strategy its options ask for (`jdp.spmd.strategies`: replicated, ZeRO, FSDP, HSDP).
The per-device functions here (`device_train_step`, `device_eval_step`) are also what
`jdp.pmap` maps.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jdp.core import _dispatch, _inputs, _options, _placement
from jdp.distributed import agree_once, require_job
from jdp.job import run
from jdp.spmd import grads as _grads
from jdp.spmd import layers as _layers
from jdp.spmd import mesh as _mesh
from jdp.spmd import outputs as _outputs
from jdp.spmd import strategies as _strategies
from jdp.spmd.mesh import AXIS


def device_train_step(state, batch, stop, *, options: StepOptions):
    """What one device does in one step, collectives over `AXIS` (what `jdp.pmap` maps): the
    replicated strategy's half on this device, the update, and the agreed stop flag."""
    replicated = _strategies.Replicated(options)
    grads, new_ms, metrics = replicated.per_device(state, batch, stop)
    return (replicated.update(state, grads, new_ms), metrics), metrics.pop(_grads.STOP)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What `jdp.train_step` was asked for, built and checked once (a bad value is a one-line
    error when the step is made, not when it runs); the step's functions read it."""

    loss_fn: Callable
    has_aux: bool = False
    grad_reduce: str = "mean"
    accum_steps: int = 1
    model_state_sync: str | None = "mean"
    comm_dtype: Any = None
    donate: bool = True
    max_in_flight: int = 2
    shard_optimizer: bool = False
    shard_params: bool | int | str = False
    compute_dtype: Any = None
    cast_batch: bool = True

    def __post_init__(self) -> None:
        try:
            checked = self._checked("jdp.train_step")
        except (TypeError, ValueError) as e:
            # every process makes the same step and refuses it alike: process 0, which holds
            # the job's coordination, lets the others print theirs before it leaves
            raise run.shared(e) from None
        # np.int64(4) is taken as 4, np.True_ as True: the frozen fields hold the checked values
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def _checked(self, who: str) -> dict:
        """The options checked (`_options`), as the step uses them."""
        checked = _options.train_options(self.grad_reduce, self.accum_steps,
                                         self.model_state_sync, self.max_in_flight,
                                         self.comm_dtype, who=who)
        _options.dtype_option("compute_dtype", self.compute_dtype)
        checked.update(_options.bool_options(
            who, has_aux=self.has_aux, donate=self.donate, shard_optimizer=self.shard_optimizer,
            cast_batch=self.cast_batch))
        checked["shard_params"] = _options.shard_params_option(self.shard_params, who)
        _options.fsdp_comm_dtype(checked["shard_params"], self.comm_dtype, self.compute_dtype)
        return checked

    @property
    def mean(self) -> bool:
        return self.grad_reduce == "mean"

    def loss_options(self) -> dict:
        """The options the gradient functions (`jdp/spmd/grads.py`) take."""
        return {"loss_fn": self.loss_fn, "has_aux": self.has_aux,
                "accum_steps": self.accum_steps, "model_state_sync": self.model_state_sync}

    def agreed(self) -> dict:
        """The options every process must have given alike (compared at the first call)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("loss_fn", "max_in_flight")}


def strategy(options: StepOptions) -> _strategies.Replicated:
    """The storage strategy the options ask for (`jdp.spmd.strategies`), `shard_params`
    resolved to its group of devices (read at trace time: "node" asks the job)."""
    group = _options.group_size(options.shard_params) if options.shard_params else None
    return _strategies.of(options, group)


def group_gradients(state, batch, stop, *, options: StepOptions):
    """The step's first half: `((grads, new_model_state, metrics), stop)`, the gradients
    reduced over all of this job's devices and stored as the update takes them. `jdp.ft`
    runs this half, reduces its output across replica groups on the host, and then
    `apply_update`."""
    grads, new_ms, metrics = strategy(options).gradients(state, batch, stop)
    return (grads, new_ms, metrics), metrics.pop(_grads.STOP)


def apply_update(state, grads, new_ms, *, options: StepOptions):
    """The step's second half: the optimizer update as the strategy stores the state, and
    the new model state (BatchNorm statistics) in its field."""
    return strategy(options).update(state, grads, new_ms)


def place_stop(flag: bool) -> jax.Array:
    """The per-device stop flags of every process as one global array along `AXIS`."""
    return _mesh.place_rows(_dispatch.stop_values(flag, jax.local_device_count()))


def train_step(loss_fn: Callable, *, has_aux: bool = False, grad_reduce: str = "mean",
               accum_steps: int = 1, model_state_sync: str | None = "mean",
               comm_dtype: Any = None, donate: bool = True, max_in_flight: int = 2,
               shard_optimizer: bool = False, shard_params: bool | int | str = False,
               compute_dtype: Any = None, cast_batch: bool = True) -> TrainStep:
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

    The state comes from `jdp.broadcast` and the batches from `jdp.data.Loader` or `jdp.shard`
    (global arrays on `jdp.mesh()`); the step is `jax.jit` of `jax.shard_map` over the mesh and
    its metrics are replicated scalars. Inputs are checked once per new signature, while jit
    traces; the call itself costs what a jitted function's dispatch costs.

    Args:
        loss_fn: pure function of one device's data; returns a scalar loss (mean over examples).
        has_aux: the loss also returns a dict of metrics, averaged over devices.
        grad_reduce: "mean" (the average over all examples) or "sum".
        accum_steps: split each device's batch into k micro-batches, sum their gradients
            locally and all-reduce once; equals one step on the whole batch.
        model_state_sync: "mean" averages model state (BatchNorm statistics) over devices after
            each step; None for statistics that agree by construction
            (`nn.BatchNorm(axis_name=jdp.AXIS)`, synced inside the forward pass). The state
            holds one model state, so None with one that differs per device is a ValueError:
            at trace time (replicated, ZeRO: a leaf computed from the device's batch with no
            collective over `jdp.AXIS`), or on the first call (FSDP, HSDP: the devices' values
            compared).
        comm_dtype: floating dtype for the gradient communication (e.g. `jnp.bfloat16`);
            None: as is.
        donate: donate the input state's buffers to the output (the old state is consumed).
        max_in_flight: steps dispatched ahead before waiting (1..16); bounds host run-ahead.
        shard_optimizer: ZeRO-1/2 (state from `jdp.broadcast(state,
            shard_optimizer=True)`): gradients reduce-scattered, each device updates its 1/N
            of the optimiser state, the updates all-gathered.
        shard_params: FSDP / ZeRO-3 (state from `jdp.broadcast(state, shard_params=True)`):
            parameters, gradients and optimizer state 1/N per device. The step runs the loss
            under `jax.vmap` over the devices and lets the compiler gather each parameter
            where it is used: a model whose layers are scanned (`lax.scan`, `nn.scan`,
            `nnx.scan`, under remat) gathers one layer at a time, forward and backward, and
            reduces that layer's gradient; an unrolled model does too when its layers are
            found (flax linen or NNX submodules, functions marked with `jdp.layer`; the rule:
            `jdp.layer_policy`), else it is gathered whole. Gradients are reduced in
            `compute_dtype` (a different `comm_dtype` is refused). HSDP: an int k
            (or "node") splits within groups of k consecutive devices (a node's), replicated
            across groups: gathers and per-layer reductions stay in a group, and the gradient
            shards are summed across the groups once a step (in `comm_dtype`).
        compute_dtype: the loss sees floating parameters cast to this dtype (e.g.
            `jnp.bfloat16`; under `shard_params` they are gathered in it, half the bytes);
            gradients come back in the parameters' own dtype and are reduced in it (or in
            `comm_dtype`) and applied to the float32 master parameters and optimizer state.
        cast_batch: with `compute_dtype`, cast the batch's floating leaves to it too (as
            PyTorch FSDP2's `cast_forward_inputs`), so a layer that promotes its inputs (flax's
            `nn.Dense` with bf16 parameters and a float32 batch) computes in `compute_dtype`;
            False passes the batch as it is. Float labels are cast too (bf16 rounds class ids
            above 256): keep labels integer, which are never cast.

    Returns:
        A `TrainStep`: `step(state, batch) -> (state, metrics)`, metrics with "loss" (and the
        aux metrics), averaged over devices. `step.lower(state, batch)` gives the lowered
        computation, `step.options` the checked options.

    Example:
        >>> import jdp, numpy as np, optax
        >>> def loss_fn(params, batch):
        ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
        >>> state = jdp.broadcast(jdp.TrainState.create(
        ...     apply_fn=None, params={"w": np.zeros((2, 1))}, tx=optax.sgd(0.1)))
        >>> n = jax.device_count()
        >>> batch = jdp.shard({"x": np.ones((n, 2)), "y": np.ones((n, 1))})
        >>> state, metrics = jdp.train_step(loss_fn)(state, batch)
        >>> float(metrics["loss"])
        1.0
    """
    return TrainStep(StepOptions(
        loss_fn, has_aux=has_aux, grad_reduce=grad_reduce, accum_steps=accum_steps,
        model_state_sync=model_state_sync, comm_dtype=comm_dtype, donate=donate,
        max_in_flight=max_in_flight, shard_optimizer=shard_optimizer,
        shard_params=shard_params, compute_dtype=compute_dtype, cast_batch=cast_batch))


class TrainStep(_dispatch.Step):
    """The step `jdp.train_step` makes: `step(state, batch) -> (state, metrics)`.

    Its `options` are the checked `StepOptions`; `lower(state, batch)` lowers it; and the two
    halves a caller that reduces gradients further between them needs (`jdp.ft`, across
    replica groups) are `gradients` and `update`.
    """

    def __init__(self, options: StepOptions) -> None:
        self.options = options
        self._donated = (0,) if options.donate else ()   # the state, when `donate`
        super().__init__(None, self.check,
                         _fsdp_placed(functools.partial(jax.jit, donate_argnums=self._donated),
                                      options), place_stop,
                         max_in_flight=options.max_in_flight, train=True,
                         donate=options.donate, announce=_announced(options),
                         after=_model_state_check(options, whole=True))

    def _traced(self, state: Any, batch: Any, stop: Any) -> Any:
        """The step at jit level: the inputs checked, then the two halves of the options'
        strategy (`strategy`): the gradients reduced over the devices, the optimizer update
        on global arrays (`group_gradients` and `apply_update` are the same halves apart)."""
        self._check_traced()
        layout = strategy(self.options)
        grads, new_ms, metrics = layout.gradients(state, batch, stop)
        return (layout.update(state, grads, new_ms), metrics), metrics.pop(_grads.STOP)

    def check(self, state: Any, batch: Any) -> None:
        """The inputs of a call that traces: a job, the state placed for these options, a
        global batch that splits into the micro-batches."""
        require_job("jdp.train_step")
        _inputs.placed_state(state, self.options.shard_optimizer, self.options.shard_params)
        _inputs.global_batch(batch, self.options.accum_steps)

    @functools.cached_property
    def gradients(self) -> _dispatch.Step:
        """The first half: `gradients(state, batch) -> (grads, new_model_state, metrics)`,
        dispatched as the whole step is (checked once per signature, announced at its first
        call, progress recorded) but never donating, so a discarded step keeps its state."""
        o = self.options
        return _dispatch.Step(functools.partial(group_gradients, options=o), self.check,
                              _fsdp_placed(jax.jit, o), place_stop,
                              max_in_flight=o.max_in_flight, train=True,
                              announce=_announced(o), after=_model_state_check(o, whole=False))

    @functools.cached_property
    def update(self) -> Callable:
        """The second half: `update(state, grads, new_model_state) -> state`, jitted and
        donating the state when `donate`."""
        return jax.jit(functools.partial(apply_update, options=self.options),
                       donate_argnums=self._donated)


def _announced(options: StepOptions) -> Callable[[int], None]:
    """The train step's agreement point: at the first call, every process's options alike."""
    return _dispatch.collective_call("train_step", "jdp.train_step", False, **options.agreed())


def _model_state_check(options: StepOptions, whole: bool) -> Callable | None:
    """The check FSDP's step (or its first half, `whole=False`) runs after a call under
    `model_state_sync=None`, which keeps device 0's model state (`_ModelStateCheck`); None
    for every other step, whose devices' model states are one by construction."""
    if not (options.shard_params and options.model_state_sync is None):
        return None
    return _ModelStateCheck(_of_step if whole else _of_gradients)


def _of_step(state: Any, out: tuple) -> tuple:
    """(field, new model state, metrics) of a whole step's `(state, metrics)`."""
    (new_state, metrics), field = out, _grads.model_state_field(out[0])
    return field, getattr(new_state, field) if field else None, metrics


def _of_gradients(state: Any, out: tuple) -> tuple:
    """(field, new model state, metrics) of the first half's `(grads, new_ms, metrics)`."""
    _, model_state, metrics = out
    return _grads.model_state_field(state), model_state, metrics


class _ModelStateCheck:
    """The devices' model states exist only inside the step, so its metrics carry which leaf
    differed (1 + its index, or 0). At the first call that has one: a ValueError unless none
    did. The entry never reaches the caller's metrics. `parts(state, out)` reads the field,
    the new model state and the metrics from a call's output."""

    def __init__(self, parts: Callable[[Any, tuple], tuple]) -> None:
        self.parts, self.done = parts, False

    def __call__(self, state: Any, out: tuple) -> None:
        field, model_state, metrics = self.parts(state, out)
        differs = metrics.pop(_grads.MODEL_STATE_DIFFERS, None)
        if differs is None or self.done:
            return
        self.done = True
        first = int(np.asarray(differs.addressable_data(0)))
        if first:
            path = jax.tree_util.tree_flatten_with_path(model_state)[0][first - 1][0]
            raise _outputs.unsynced_model_state(field + jax.tree_util.keystr(path),
                                               "came out different on the devices")


def _fsdp_placed(transform: Callable, options: StepOptions) -> Callable:
    """`transform` itself, or under FSDP one that keeps whichever placement of the gathers
    peaks lower, layer by layer or the compiler's (`_placement`); the compiler's alone when
    the loss's `layer_policy` is `enabled=False` (its `jdp.layer` marks too)."""
    if not options.shard_params:
        return transform
    if not _layers.policy_of(options.loss_fn).enabled:
        return lambda body: transform(_placement.by_compiler(body))
    return lambda body: _placement.LowerPeak(body, transform, "jdp.train_step")


def device_eval_step(state, batch, stop, *, metric_fn):
    """Mask-weighted sums of per-example metrics over all devices, plus the example count."""
    del stop
    values = metric_fn(state, batch)
    first = jax.tree.leaves(batch)[0]
    mask = batch["mask"] if isinstance(batch, dict) and "mask" in batch else jnp.ones(
        first.shape[0], bool)
    _outputs.per_example(values, mask.shape[0])
    _outputs.boolean_mask(mask)
    sums = {k: jnp.sum(jnp.where(mask, v, 0), dtype=jnp.float32) for k, v in values.items()}
    sums["count"] = jnp.sum(mask, dtype=jnp.float32)
    totals = lax.psum(sums, AXIS)
    return totals, totals["count"]


def eval_step(metric_fn: Callable, *, max_in_flight: int = 2) -> _dispatch.Step:
    """Make a data-parallel evaluation that is exact over padded batches.

    `metric_fn(state, batch)` runs on one device's slice and returns a dict of per-example
    values of shape `[per_device_batch]`. The step sums each over the real examples of all
    devices of all processes (`batch["mask"]` False rows count for nothing) and adds "count",
    so `sum / count` is the exact mean over the split however it was padded. A metric named
    "count" would be overwritten, and is refused (ValueError) while the step traces.

    Args:
        metric_fn: `metric_fn(state, batch) -> {name: per-example values [per_device_batch]}`.
        max_in_flight: evaluations dispatched ahead before waiting.

    Returns:
        `evaluate(state, batch) -> totals`: replicated scalars.

    Example:
        >>> import jdp, numpy as np
        >>> def metric_fn(state, batch):
        ...     return {"sq": (batch["x"] * state["w"]) ** 2}
        >>> n = jax.device_count()
        >>> batch = jdp.shard({"x": np.ones(2 * n), "mask": np.arange(2 * n) < 2 * n - 1})
        >>> totals = jdp.eval_step(metric_fn)(jdp.broadcast({"w": np.float32(2)}), batch)
        >>> float(totals["sq"]) / float(totals["count"])
        4.0
    """
    max_in_flight = _options.train_options("mean", 1, "mean", max_in_flight,
                                          who="jdp.eval_step")["max_in_flight"]
    # While the step traces a new input signature, before it can run, the processes agree on
    # the tree metric_fn returns (names, dtypes, per-device shapes): metrics that differ would
    # be summed into each other by the one psum, or hang it, and each process would go on
    # with its own answer. One process: `agree_once` returns at once.
    who, agreed = "jdp.eval_step", set()
    tree: list = []   # the metric tree of the trace under way, as shapes and dtypes
    per_device = functools.partial(device_eval_step, metric_fn=_noting(metric_fn, tree))

    def body(state, batch, stop):
        totals = jax.shard_map(per_device, mesh=_mesh.mesh(), in_specs=(P(), P(AXIS), P(AXIS)),
                               out_specs=P())(state, batch, stop)
        agree_once(agreed, "eval-metrics", tree[0], who, "every process's metric_fn must "
                   "return the same metrics (names, dtypes, per-example shapes) for the same "
                   "batch")
        return totals

    def check(state, batch):
        require_job(who)
        _inputs.placed_state(state, shard_optimizer=None)
        batch_rows(batch, who)
        _inputs.global_batch(batch, 1)

    return _dispatch.Step(body, check, jax.jit, place_stop, max_in_flight=max_in_flight,
                          train=False, announce=_dispatch.collective_call("eval_step", who, True))


def _noting(metric_fn: Callable, tree: list) -> Callable:
    """`metric_fn`, noting as `tree[0]` the shapes and dtypes it returns each time it traces
    (None for leaves that are no arrays: the step's own check names those)."""
    def noted(state, batch):
        values = metric_fn(state, batch)
        try:
            tree[:] = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x),
                                                                   jnp.result_type(x)), values)]
        except TypeError:
            tree[:] = [None]
        return values
    return noted


def batch_rows(batch: Any, who: str) -> None:
    """An evaluation's batch, said in rows: every leaf has as many, they split evenly over
    all devices, and `batch["mask"]` is one flag a row."""
    leaves, n = _inputs.batch_leaves(batch), jax.device_count()
    (first, x0), *rest = leaves
    if not jnp.shape(x0):
        raise ValueError(f"{who}: batch leaf {_outputs.leaf_name(first)} is a scalar; a batch "
                         "holds one row per example: pass arrays [rows, ...] (jdp.shard(rows) "
                         "or a jdp.data.Loader's batches)")
    rows = jnp.shape(x0)[0]
    for path, x in rest:
        if jnp.shape(x)[:1] != (rows,):
            raise ValueError(f"{who}: batch leaf {_outputs.leaf_name(path)} has "
                             f"{jnp.shape(x)[0] if jnp.shape(x) else 'no'} rows but "
                             f"{_outputs.leaf_name(first)} has {rows}: every leaf holds one row "
                             "per example")
    if rows % n:
        raise ValueError(f"{who}: the batch has {rows} rows, which do not split evenly over the "
                         f"{n} devices: pass a multiple of {n} rows (a jdp.data.Loader pads the "
                         "last batch and masks the padding out)")
    mask = batch.get("mask") if isinstance(batch, dict) else None
    if mask is not None and jnp.ndim(mask) != 1:
        raise ValueError(f"{who}: batch['mask'] has shape {jnp.shape(mask)}; expected one flag "
                         f"per row, shape ({rows},): True for the rows that count")
