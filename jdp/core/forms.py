"""Which form a tree is in, global or the classic pmap form: known from placement, never shapes.

jdp's global arrays live on `jdp.mesh()`. `jdp.pmap` places every array it makes (`replicate`,
`shard`, the Loader's `layout="pmap"`, its steps' outputs) on a mesh of the local devices whose
one axis is `LOCAL_AXIS`: that axis name is the mark of the pmap form. A shape tells nothing: a
ZeRO/FSDP leaf padded to N rows, or a global batch of N rows, has exactly the shape of a stacked
leaf. A leaf split one row per local device on a mesh of someone else's (a hand-written
`jax.pmap`'s output, or a global array on your own mesh) could be either: the calls that would
lose or misplace values on a wrong guess (Checkpointer, `jdp.broadcast`, `jdp.unshard`) refuse
it; `jdp.pmap.unreplicate` and the pmap step, whose caller says the tree is stacked, take it so.
Every caller asks `leaf_form` / `tree_form`, and nothing else in jdp asks. (On one process a
hand-written `jax.pmap(..., axis_name=jdp.AXIS)` returns arrays exactly like jdp's global
ones, mesh included: they count as global. `jdp.pmap.train_step` marks its outputs.)
"""
from __future__ import annotations

from typing import Any

import jax

from jdp.spmd import mesh as _mesh

LOCAL_AXIS = "local_devices"
"""Axis name of the pmap form's placement: on one process a stacked `[8, b]` array and a global
batch of 8 rows have the same devices and shape, and only this name tells them apart."""

PMAP, GLOBAL, EITHER = "pmap", "global", "either"
_PMAP_DEFAULT_AXIS = "_internal_pmap_axis_name"  # jax.pmap's axis name when given none


def leaf_form(x: Any) -> str:
    """PMAP (placed by jdp.pmap, or by a `jax.pmap` without an axis name), EITHER (split one row
    per local device over a 1-D mesh that is not jdp's), or GLOBAL (anything else)."""
    if not isinstance(x, jax.Array) or not x.ndim:
        return GLOBAL
    spec, mesh = getattr(x.sharding, "spec", None), getattr(x.sharding, "mesh", None)
    if not spec or spec[0] is None or mesh is None:
        return GLOBAL
    if spec[0] in (LOCAL_AXIS, _PMAP_DEFAULT_AXIS):
        return PMAP
    local = jax.local_devices()
    if (mesh == _mesh.mesh() or len(mesh.axis_names) != 1 or mesh.size != len(local)
            or x.shape[0] != mesh.size or set(mesh.devices.flat) != set(local)):
        return GLOBAL
    return EITHER


def tree_form(tree: Any, who: str) -> str:
    """PMAP when every array leaf is in the pmap form, GLOBAL when none is.

    Raises:
        ValueError: a leaf that could be either form, or a tree mixing both (named).
    """
    leaves = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
              if isinstance(x, jax.Array)]
    forms = [(p, leaf_form(x)) for p, x in leaves]
    either = [p for p, f in forms if f == EITHER]
    if either:
        raise ValueError(
            f"{who}: leaf {_name(either[0])} is split one row per local device on a mesh that "
            "is not jdp's (a hand-written jax.pmap's output, or a global array on your own "
            "mesh), so its form is unknown: place it with jdp.pmap.replicate / jdp.pmap.shard "
            "(the pmap form) or jdp.broadcast / jdp.shard (global arrays)")
    stacked = [p for p, f in forms if f == PMAP]
    if stacked and len(stacked) < len(forms):
        other = next(p for p, f in forms if f != PMAP)
        raise ValueError(
            f"{who}: the tree mixes the pmap form (leaf {_name(stacked[0])}, placed by "
            f"jdp.pmap) and global arrays (leaf {_name(other)}): put the whole tree in one "
            "form (jdp.pmap.replicate(jdp.pmap.unreplicate(tree)) or jdp.broadcast(...))")
    return PMAP if stacked else GLOBAL


def _name(path: Any) -> str:
    return jax.tree_util.keystr(path) or "<root>"
