"""Input checks for the parallel steps: options when a step is made, inputs when it traces.

Each error names the offending value, what was expected, and the fix, because inside the
compiled step the same mistakes surface as shape errors deep in XLA. The input checks run once
per new input signature (while jit traces), never on the per-step path.
"""
from __future__ import annotations

import operator
from typing import Any

import jax
import jax.numpy as jnp

from jdp.core import _mesh, _storage, forms
from jdp.job import values

MAX_IN_FLIGHT = 16


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


def trainable(params: Any) -> None:
    """The parameters the gradient is taken of: at least one leaf, every leaf floating."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if not leaves:
        raise ValueError("the train state's params are empty ({} or None): the loss has nothing "
                         "to train; pass the model's parameters to TrainState.create(params=...)")
    for path, x in leaves:
        dtype = x.dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"parameter leaf {leaf_name(path)} has dtype {dtype}: jdp takes the "
                             "gradient of every parameter, so they must be floating; keep "
                             "integer values out of params (e.g. in model_state, or as constants)")


def _is_float_dtype(dtype: Any) -> bool:
    try:
        return jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        return False


def leaf_name(path) -> str:
    """A tree path as users write it (`['params']['w']`), or <root>."""
    return jax.tree_util.keystr(path) or "<root>"


def not_donated(state: Any) -> None:
    """A state whose buffers went to an earlier step (donation) cannot be used again."""
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(x, jax.Array) and x.is_deleted():
            raise RuntimeError(
                f"state leaf {leaf_name(path)} was donated to an earlier step (its buffers now "
                "hold that step's output): use the state the step returned, `state, metrics = "
                "step(state, batch)`, or build the step with donate=False to keep old states")


def placed_state(state: Any, shard_optimizer: bool | None, shard_params: bool = False) -> None:
    """Every leaf of the state is a global array on `jdp.mesh()`: replicated, except what
    `jdp.broadcast` shards along `jdp.AXIS` (the optimizer state under ZeRO, the parameters too
    under FSDP). `shard_optimizer=None` (an evaluation) takes every form."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    if not leaves:
        raise ValueError(f"state {type(state).__name__} has no array leaves: pass the train "
                         "state, placed with jdp.broadcast(state)")
    if forms.tree_form(state, "jdp.train_step") == forms.PMAP:
        raise ValueError(f"state leaf {leaf_name(leaves[0][0])} is not replicated on "
                         "jdp.mesh(): place the state with jdp.broadcast(state) (it is in the "
                         "pmap form, placed by jdp.pmap: jdp.pmap.unreplicate it first), or keep "
                         "the form and use jdp.pmap.train_step")
    for path, x in leaves:
        if not (isinstance(x, jax.Array) and x.sharding.device_set == _mesh_devices()):
            raise ValueError(
                f"state leaf {leaf_name(path)} is {_where(x)}, not a global array on jdp.mesh(): "
                "place the state with jdp.broadcast(state) (a state from jdp.replicate, the "
                "pmap form, goes with jdp.pmap.train_step)")
    params = getattr(state, "params", None)
    opt = getattr(state, "opt_state", None)
    stored = {id(x) for x in jax.tree.leaves((params, opt))}
    for path, x in leaves:
        if id(x) not in stored and not x.sharding.is_fully_replicated:
            raise ValueError(f"state leaf {leaf_name(path)} is not replicated on jdp.mesh(): place "
                             "the state with jdp.broadcast(state) (a state from jdp.replicate, "
                             "the pmap form, goes with jdp.pmap.train_step)")
    if shard_optimizer is None:
        return
    trainable(params)
    _params_as_stored(params, shard_params)
    _opt_as_stored(opt, shard_optimizer, shard_params)


def _params_as_stored(params: Any, shard_params: Any) -> None:
    """The parameters are placed as the step's `shard_params` stores them: split by the
    rule over all devices or within groups (`jdp.broadcast(state, shard_params=...)`), or
    replicated."""
    group = _storage.group_size(shard_params) if shard_params else None
    have = _storage.params_group(params)
    if shard_params and any(_split(x) for x in jax.tree.leaves(params)):
        _same_groups(shard_params, have)
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        want = _storage.stored_sharding(x, group) if shard_params else _mesh.replicated()
        if x.sharding.is_equivalent_to(want, x.ndim):
            continue
        if shard_params:
            raise ValueError(f"shard_params={shard_params!r}: the parameters are not sharded "
                             f"as the step stores them ({leaf_name(path)} is not); place the "
                             f"state with jdp.broadcast(state, shard_params={shard_params!r})")
        raise ValueError(f"the parameters are sharded ({leaf_name(path)}: jdp.broadcast(state, "
                         f"shard_params={have or True!r})): pass shard_params={have or True!r} "
                         "to the step too")


def _opt_as_stored(opt: Any, shard_optimizer: bool, shard_params: Any) -> None:
    """The optimizer state is split (ZeRO, FSDP) exactly when the step's options say so."""
    n = _storage.ways(_storage.group_size(shard_params) if shard_params else None)
    splittable = [x for x in jax.tree.leaves(opt)
                  if _storage.opt_axis(x, n, bool(shard_params)) is not None]
    split = [_split(x) for x in splittable]
    if (shard_optimizer or shard_params) and not all(split):
        option = f"shard_params={shard_params!r}" if shard_params else "shard_optimizer=True"
        raise ValueError(f"{option}: the optimizer state is not sharded; place the state with "
                         f"jdp.broadcast(state, {option})")
    if not (shard_optimizer or shard_params) and any(split):
        raise ValueError("the optimizer state is sharded (jdp.broadcast(state, "
                         "shard_optimizer=True)): pass shard_optimizer=True to the step too")


def dtype_option(option: str, dtype: Any) -> None:
    """A dtype option must be a floating dtype, or None."""
    if dtype is not None and not _is_float_dtype(dtype):
        raise ValueError(f"{option}={dtype!r}: expected a floating dtype such as jnp.bfloat16, "
                         "or None")


def _split(x: jax.Array) -> bool:
    """Split along `jdp.AXIS` on some axis, or within groups of devices (HSDP)."""
    spec = tuple(getattr(x.sharding, "spec", ()))
    return _mesh.AXIS in spec or _mesh.SHARD in spec


def _same_groups(shard_params: Any, have: int | None) -> None:
    """The step's `shard_params` splits as the state was placed (all devices, or groups)."""
    want = _storage.group_size(shard_params)
    if want != have:
        placed = f"groups of {have} devices" if have else "all devices"
        raise ValueError(f"shard_params={shard_params!r}: the state's parameters are split over "
                         f"{placed} (jdp.broadcast(state, shard_params={have or True!r})), not "
                         f"{f'groups of {want}' if want else 'all devices'}; pass the same "
                         "shard_params to jdp.broadcast and jdp.train_step")


SHARD_PARAMS = ('True or False, "node", or an int >= 2 that divides the device count (HSDP: '
                'groups of that many consecutive devices)')


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


def _on_mesh(x: jax.Array) -> bool:
    """On `jdp.mesh()`'s devices, and on the mesh itself where the sharding names one."""
    mesh = getattr(x.sharding, "mesh", None)
    return x.sharding.device_set == _mesh_devices() and (mesh is None or mesh == _mesh.mesh())


def _mesh_devices() -> set:
    return set(_mesh.mesh().devices.flat)


def _where(x: Any) -> str:
    if isinstance(x, jax.Array):
        return f"an array of shape {x.shape} on {len(x.sharding.device_set)} device(s)"
    return f"a {type(x).__name__} of shape {jnp.shape(x)}"


def batch_leaves(tree: Any) -> list:
    """(path, leaf) of every batch leaf; a ValueError for an empty batch."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not leaves:
        raise ValueError("batch is empty: expected a pytree of arrays")
    return leaves


def one_size(leaves: list, axis: int, what: str) -> int:
    """The size every batch leaf has on `axis`; a ValueError naming a leaf that differs."""
    (first, x0), *rest = leaves
    size = jnp.shape(x0)[axis]
    for path, x in rest:
        if jnp.shape(x)[axis] != size:
            raise ValueError(f"batch leaf {leaf_name(path)} has {jnp.shape(x)[axis]} "
                             f"examples{what} but {leaf_name(first)} has {size}: every leaf "
                             f"needs the same {'per-device batch' if what else 'batch size'}")
    return size


def global_batch(tree: Any, accum_steps: int) -> None:
    """Batch leaves: global arrays on `jdp.mesh()` (or host arrays on one process) with one
    leading size that splits evenly over all devices and micro-batches."""
    leaves, n = batch_leaves(tree), jax.device_count()
    for path, x in leaves:
        shape = jnp.shape(x)
        if isinstance(x, jax.Array) and x.ndim and not _on_mesh(x):
            raise ValueError(f"batch leaf {leaf_name(path)} is {_where(x)}, not a global batch on "
                             "jdp.mesh(): make batches with jdp.shard(rows) or jdp.data.Loader "
                             "(pmap-form batches [local_devices, ...] go with jdp.pmap.train_step)")
        if jax.process_count() > 1 and not isinstance(x, jax.Array):
            raise ValueError(f"batch leaf {leaf_name(path)} is a host {type(x).__name__}: on "
                             f"{jax.process_count()} processes a batch must be global arrays; "
                             "make it with jdp.shard(rows) or jdp.data.Loader")
        if not shape or shape[0] % (n * accum_steps):
            raise ValueError(f"batch leaf {leaf_name(path)} has shape {shape}: the global "
                             f"batch must split evenly over {n} devices x "
                             f"accum_steps={accum_steps}; use a global batch size that is a "
                             f"multiple of {n * accum_steps}")
    one_size(leaves, 0, "")


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
