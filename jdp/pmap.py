"""The classic pmap form: state stacked `[local_devices, ...]`, the step a real `jax.pmap`.

(Interim: re-exports while the core is rewritten; the interface below is final.)
"""
from __future__ import annotations

from typing import Any

import jax

from jdp.core import _mesh, _state, _step


def replicate(tree: Any) -> Any:
    """One copy of every leaf on each local device: leaves `[local_devices, ...]`."""
    return _state.replicate(tree)


def unreplicate(tree: Any) -> Any:
    """Device 0's copy of a stacked tree; global leaves come back unchanged."""
    return _state.unreplicate(tree)


def shard(rows: Any) -> Any:
    """This process's rows `[n*b, ...]` split over the local devices: `[n, b, ...]`."""
    return _state.shard(rows, layout=_mesh.STACKED)


def place_rows(rows: Any, devices=None) -> Any:
    """Like `shard`, onto `devices` (default: the local devices in pmap's order), no checks."""
    return _mesh.place_batch(rows, _mesh.STACKED,
                             None if devices is None else _mesh.local_sharding(devices))


def train_step(loss_fn, **options):
    """`jdp.train_step` for a stacked state and `[local_devices, b, ...]` batches, as pmap."""
    return _step.train_step(loss_fn, **options)


def eval_step(metric_fn, **options):
    """`jdp.eval_step` for a stacked state and batches."""
    return _step.eval_step(metric_fn, **options)


def is_stacked(tree: Any) -> bool:
    """Whether `tree` is in the pmap form (judged by its params, or its first array leaf)."""
    return _state.layout(tree) == _mesh.STACKED


def to_global(tree: Any) -> Any:
    """One copy of a stacked tree as global arrays replicated on `jdp.mesh()`; any other tree
    unchanged."""
    if not is_stacked(tree):
        return tree
    one = jax.device_get(unreplicate(tree))
    return jax.tree.map(lambda x: _state._place(x, _mesh.replicated()), one)


def like(template: Any, tree: Any) -> Any:
    """`tree` in `template`'s form: stacked (replicated on the local devices) if the template
    is, else unchanged."""
    return replicate(jax.device_get(tree)) if is_stacked(template) else tree
