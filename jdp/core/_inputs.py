"""A step's inputs, checked while it traces a new input signature (never on the per-step path):
the state placed as the step's options store it, a batch of global arrays that splits over
the devices and into the micro-batches, parameters that can be trained, buffers not donated.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jdp.core import _options, forms
from jdp.spmd import mesh as _mesh
from jdp.spmd import storage as _storage
from jdp.spmd.outputs import leaf_name


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
    group = _options.group_size(shard_params) if shard_params else None
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
    n = _storage.ways(_options.group_size(shard_params) if shard_params else None)
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


def _split(x: jax.Array) -> bool:
    """Split along `jdp.AXIS` on some axis, or within groups of devices (HSDP)."""
    spec = tuple(getattr(x.sharding, "spec", ()))
    return _mesh.AXIS in spec or _mesh.SHARD in spec


def _same_groups(shard_params: Any, have: int | None) -> None:
    """The step's `shard_params` splits as the state was placed (all devices, or groups)."""
    want = _options.group_size(shard_params)
    if want != have:
        placed = f"groups of {have} devices" if have else "all devices"
        raise ValueError(f"shard_params={shard_params!r}: the state's parameters are split over "
                         f"{placed} (jdp.broadcast(state, shard_params={have or True!r})), not "
                         f"{f'groups of {want}' if want else 'all devices'}; pass the same "
                         "shard_params to jdp.broadcast and jdp.train_step")


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
