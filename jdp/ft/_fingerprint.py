"""A replica group's set-up as a few short texts, and the first difference between groups.

Groups that train together must have built the same thing: the same trees of parameters and
optimizer state, the same layout inside the group, the same data split. A difference would
otherwise end in a raw error on one side (buffers of other sizes in the all-reduce, a heal
into another tree) while the other waits, or in a silently wrong run (a duplicated group
index, every group reading the same examples). Each field is a short text, so a difference
names both values in one line; a tree is summarized (leaves, values, dtypes, node types) with
a CRC of its key paths, shapes and dtypes.

Pure functions over JAX trees and plain values; `_agreement` carries the texts across groups.
"""
from __future__ import annotations

import inspect
import re
import zlib
from typing import Any

import jax
import numpy as np

from jdp.ft import _exchange

# (key, what it is): compared in this order, the first difference is named
FIELDS = (
    ("groups", "number of replica groups (--replica_groups)"),
    ("processes", "processes per group"),
    ("devices", "devices per group"),
    ("params", "parameters' tree"),
    ("model_state", "model state's tree"),
    ("opt_state", "optimizer state's tree"),
    ("state", "state's tree"),
    ("options", "train_step options"),
    ("held", "values each process holds (the layout inside the group)"),
    ("batch", "per-process batch size"),
    ("sampler", "sampler"),
    ("num_steps", "num_steps"),
    ("min_groups", "min_groups"),
    ("sync", "syncs (Replicas' sync_every and outer)"),
)
STATE_FIELDS = ("params", "model_state", "opt_state", "state", "held")
MAX_VALUE = 160          # characters of one field's text
_IGNORED_OPTIONS = ("donate", "max_in_flight")   # this process's choices, no effect on others
_FIX = "start every group with the same script and options"


def of_state(state: Any) -> dict:
    """The state's fields: each part's tree (the parameters, the model state and optimizer
    state when the state has them, the whole tree) and what this process holds of it."""
    out = {key: tree_text(getattr(state, key)) for key in ("params", "model_state", "opt_state")
           if hasattr(state, key)}
    out["state"] = tree_text(state)
    out["held"] = held_text(state)
    return out


def of_job(groups: int, processes: int, devices: int, min_groups: int) -> dict:
    """The job's fields: how many groups, how big each is, and the fewest a fresh job may
    start with (the group's own index travels beside the fingerprint, never compared)."""
    return {"groups": str(groups), "processes": str(processes), "devices": str(devices),
            "min_groups": str(min_groups)}


def of_options(options: dict, defaults: dict | None = None) -> str:
    """The train_step options that change what crosses the groups, as `name=value` (those
    left at jdp.train_step's defaults omitted): 'defaults', or e.g. 'shard_params=2'."""
    defaults = step_defaults() if defaults is None else defaults
    given = {k: _plain(v) for k, v in options.items() if k not in _IGNORED_OPTIONS}
    shown = [f"{k}={v}" for k, v in sorted(given.items()) if v != _plain(defaults.get(k))]
    return ", ".join(shown) or "defaults"


def step_defaults() -> dict:
    """jdp.train_step's keyword defaults, read from its signature."""
    from jdp.core import train_step
    return {name: p.default for name, p in inspect.signature(train_step).parameters.items()
            if p.kind is p.KEYWORD_ONLY}


def of_loader(loader: Any, group: int, groups: int, processes: int, index: int) -> tuple:
    """`(fields, problem)`: the loader's batch size and sampler as texts, and a one-line
    problem (or None) when the sampler is not `jdp.ft.sampler`'s for this group, so every
    group would read the same examples."""
    if loader is None:
        return {"batch": "no loader", "sampler": "no loader"}, None
    sampler = loader.sampler
    fields = {"batch": f"{loader.batch_size} (drop_last={getattr(loader, 'drop_last', None)})",
              "sampler": (f"num_examples={sampler.num_examples}, seed={sampler.seed}, "
                          f"shuffle={sampler.shuffle}, drop_last={sampler.drop_last}")}
    want = (group * processes + index, groups * processes)
    have = (sampler.rank, sampler.num_replicas)
    if have == want:
        return fields, None
    return fields, (f"its loader's sampler is rank {have[0]} of {have[1]}, not rank {want[0]} "
                    f"of {want[1]} as jdp.ft.sampler gives process {index} of replica group "
                    f"{group}: the groups would read the same examples; build the Loader with "
                    "sampler=jdp.ft.sampler(len(source))")


def tree_text(tree: Any) -> str:
    """'ScaleByAdamState, EmptyState: 5 leaves, 2305 values (float32, int32) #1a2b3c4d': the
    node types, the leaves, their values and dtypes, and a CRC of their key paths, global
    shapes and dtypes (equal trees, equal texts; the function objects a state may carry
    are left out)."""
    if tree is None:
        return "none"
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    crc, size, dtypes = 0, 0, []
    for path, leaf in flat:
        shape, dtype = tuple(np.shape(leaf)), _dtype_name(leaf)
        crc = zlib.crc32(f"{jax.tree_util.keystr(path)}:{shape}:{dtype};".encode(), crc)
        size += int(np.prod(shape, dtype=np.int64))
        if dtype not in dtypes:
            dtypes.append(dtype)
    kinds = _node_types(treedef)
    head = f"{', '.join(kinds)}: " if kinds else ""
    values = f", {size} values ({', '.join(dtypes)})" if flat else ""
    text = f"{head}{len(flat)} leaves{values} #{crc:08x}"
    return _short(text)


def held_text(tree: Any) -> str:
    """What this process holds of `tree` (the pieces it exchanges): values per dtype and the
    number of pieces, from the shards' shapes (nothing is copied)."""
    counts: dict = {}
    pieces = 0
    for leaf in jax.tree.leaves(tree):
        if not hasattr(leaf, "addressable_shards"):
            continue
        for _, shard in _exchange.pieces(leaf):
            name = _dtype_name(leaf)
            counts[name] = counts.get(name, 0) + int(np.prod(shard.data.shape, dtype=np.int64))
            pieces += 1
    values = ", ".join(f"{n} {name}" for name, n in counts.items()) or "nothing"
    return f"{values} in {pieces} pieces"


def difference(rows: list) -> str | None:
    """The first thing that differs among the groups' rows (each {"group", "fp": fields,
    "problem"}), as the one line every group raises; None when they agree. The order is
    fixed and the rows are the same on every group, so every group names the same thing."""
    for row in rows:
        if row.get("problem"):
            return f"jdp.ft: replica group {row['group']}: {row['problem']}"
    for key, what in FIELDS:
        found = _differing(rows, key)
        if found is not None:
            (a, va), (b, vb) = found
            return (f"jdp.ft: replica groups {a} and {b} differ in the {what}: {va} on group "
                    f"{a}, {vb} on group {b}; {_FIX}")
    seen: dict = {}
    for row in rows:
        if row["group"] in seen:
            g = row["group"]
            return (f"jdp.ft: replica group {g} joined twice (two launchers with "
                    f"--replica_group {g}, or JDP_REPLICA_GROUP={g} twice): its gradient "
                    "would count twice; give each group its own index 0..R-1")
        seen[row["group"]] = row
    return None


def heal_difference(theirs: dict | None, mine: dict) -> str | None:
    """The first state field in which a peer's served state differs from this group's (the
    peer's fields as served with it), or None when it can be placed here."""
    theirs = theirs or {}
    for key in STATE_FIELDS:
        if theirs.get(key) != mine.get(key):
            what = dict(FIELDS)[key]
            return (f"jdp.ft: the state a live replica group served for this group's heal "
                    f"differs in the {what}: {theirs.get(key)} there, {mine.get(key)} here; "
                    f"{_FIX}")
    return None


def _differing(rows: list, key: str) -> tuple | None:
    """The first two rows, in order, whose values of `key` differ (a value of None, not yet
    known, is not compared): ((group, value), (group, value)), or None."""
    known = [(r["group"], r["fp"].get(key)) for r in rows if r["fp"].get(key) is not None]
    for g, value in known[1:]:
        if value != known[0][1]:
            return known[0], (g, value)
    return None


def _node_types(treedef: Any) -> list:
    """The class names of a tree's nodes (an optimizer state's `ScaleByAdamState`), each once,
    at most four, from the treedef's text (`CustomNode(namedtuple[ScaleByAdamState], ...)`)."""
    out: list = []
    for name in re.findall(r"(?<=namedtuple\[)\w+|(?<=CustomNode\()\w+", str(treedef)):
        if name != "namedtuple" and name not in out:
            out.append(name)
    return out[:4]


def _dtype_name(leaf: Any) -> str:
    dtype = getattr(leaf, "dtype", None)
    return str(dtype) if dtype is not None else type(leaf).__name__


def _plain(value: Any) -> Any:
    """An option's value as text that compares alike across processes: dtypes by name,
    NumPy scalars as Python ones."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    try:
        return np.dtype(value).name
    except TypeError:
        return repr(value)


def _short(text: str) -> str:
    return text if len(text) <= MAX_VALUE else text[:MAX_VALUE - 3] + "..."
