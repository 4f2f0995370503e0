"""Collective traffic of a compiled step, read from its HLO text.

DDP's cost model is "one all-reduce of the gradient bytes per step"; counting the ops and bytes
in `step.lower(...).compile().as_text()` checks that nothing else is sent and nothing twice.
"""
from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import numpy as np

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# `%name = <result shape> all-reduce(`, or the async `all-reduce-start(` (not `-done`).
_OP = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.+?)\s+(all-reduce|reduce-scatter|all-gather)"
                 r"(?:-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


class Collective(NamedTuple):
    """Ops of one kind in a compiled step: how many, bytes of their results, arrays."""
    ops: int = 0
    bytes: int = 0
    arrays: int = 0


def collectives(hlo_text: str) -> dict[str, Collective]:
    """A `Collective` per kind (all-reduce, reduce-scatter, all-gather) of an HLO module."""
    found = dict.fromkeys(("all-reduce", "reduce-scatter", "all-gather"), Collective())
    for kind, size, arrays in _each(hlo_text):
        c = found[kind]
        found[kind] = Collective(c.ops + 1, c.bytes + size, c.arrays + arrays)
    return found


def each_collective(hlo_text: str) -> list[tuple[str, int]]:
    """(kind, result bytes) of every collective op of an HLO module, in program order: FSDP's
    per-layer gathers show as one all-gather per parameter of a layer, none of a whole model."""
    return [(kind, size) for kind, size, _ in _each(hlo_text)]


def _each(hlo_text: str):
    for line in hlo_text.splitlines():
        if match := _OP.match(line):
            shapes = [(t, d) for t, d in _SHAPE.findall(match.group(1)) if t in _BYTES]
            size = sum(int(np.prod([int(x) for x in d.split(",") if x])) * _BYTES[t]
                       for t, d in shapes)
            yield match.group(2), size, len(shapes)


def ring_bytes(found: dict[str, Collective], n: int) -> float:
    """Bytes each of `n` devices sends per step under ring algorithms: an all-reduce of S sends
    2(n-1)/n S, a reduce-scatter to S/n and an all-gather to S send (n-1)/n S each."""
    return (n - 1) / n * (2 * found["all-reduce"].bytes + n * found["reduce-scatter"].bytes
                          + found["all-gather"].bytes)


def expected_bytes(params: Any, model_state: Any, metric_scalars: int) -> int:
    """What a DDP step all-reduces: the gradient (= parameter bytes), the floating model state
    (BatchNorm statistics) and one float32 per metric."""
    leaves = [np.asarray(x) for x in jax.tree.leaves((params, model_state))]
    return sum(x.nbytes for x in leaves if np.issubdtype(x.dtype, np.floating)) + 4 * metric_scalars


def replica_groups(line: str) -> list[tuple[int, ...]]:
    """The device groups of one collective's HLO line: `replica_groups={{0,1},{2,3}}`, the
    list form `replica_groups=[2,4]<=[8]` (iota in rows of 4), or the mesh form
    `replica_groups=mesh['axis_0'=4,...], device_ids=([2,4]T(1,0)) {'axis_0'}`."""
    explicit = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
    if explicit:
        return sorted(tuple(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}",
                                                                        explicit[1]))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:     # `[groups,size]<=[dims]T(perm)`: iota over dims, transposed, in rows of size
        ids = np.arange(int(np.prod([int(d) for d in iota[3].split(",")])))
        ids = ids.reshape([int(d) for d in iota[3].split(",")])
        if iota[4]:
            ids = ids.transpose([int(a) for a in iota[4].split(",")])
        return sorted(tuple(g) for g in ids.reshape(int(iota[1]), int(iota[2])).tolist())
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]T\(([\d,]+)"
                  r"\)\))? \{([^}]*)\}", line)
    if not m:
        return []
    dims = re.findall(r"'(\w+)'=(\d+)", m[1])
    sizes = [int(s) for _, s in dims]
    ids = np.arange(int(np.prod(sizes)))
    if m[2]:
        ids = ids.reshape([int(s) for s in m[2].split(",")]).transpose(
            [int(s) for s in m[3].split(",")])
    ids = ids.reshape(sizes)
    named = re.findall(r"'(\w+)'", m[4])
    axes = [i for i, (name, _) in enumerate(dims) if name in named]
    rest = [i for i in range(len(dims)) if i not in axes]
    groups = ids.transpose(rest + axes).reshape(-1, int(np.prod([sizes[a] for a in axes])))
    return sorted(tuple(g) for g in groups.tolist())


def grouped(hlo_text: str) -> list[tuple[str, int, list[tuple[int, ...]], int]]:
    """(kind, result bytes, device groups, runs per step) of every all-reduce, reduce-scatter
    and all-gather; runs: the known trip counts of the while loops around it, multiplied."""
    out, runs, where, loops = [], {}, None, {}
    for line in hlo_text.splitlines():
        if header := re.match(r"^(?:ENTRY\s+)?%?(\S+)\s.*\{\s*$", line):
            where = header.group(1)
        if body := re.search(r"\bwhile\(.*\bbody=%?([\w.\-]+)", line):
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            loops[body.group(1)] = (where, int(trips.group(1)) if trips else 1)
        if match := _OP.match(line):
            size = sum(int(np.prod([int(x) for x in d.split(",") if x])) * _BYTES[t]
                       for t, d in _SHAPE.findall(match.group(1)) if t in _BYTES)
            out.append((match.group(2), size, replica_groups(line), where))

    def times(name, depth=0):
        if name not in loops or depth > 16:
            return 1
        parent, trips = loops[name]
        return trips * times(parent, depth + 1)

    return [(kind, size, groups, runs.setdefault(name, times(name)))
            for kind, size, groups, name in out]


def crossing_bytes(hlo_text: str, node_size: int) -> int:
    """Result bytes per step of the collectives whose device groups span more than one node
    (nodes of `node_size` consecutive devices): what a step sends between nodes."""
    return sum(size * runs for _, size, groups, runs in grouped(hlo_text)
               if any(len({d // node_size for d in g}) > 1 for g in groups))
