"""Who this process is in the job, process 0's values for everyone, and checks that the
processes agree before a collective that would otherwise hang or mix their values.

Agreement goes through the coordination service's key-value store (timed gets), never a
device collective: a process that disagrees, or never comes, turns into an error on every
process, naming what differs and where, instead of a hang.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from jdp.distributed import _init
from jdp.launch import _env

_job_checked = False   # require_job passed once: later calls cost one global read
_rounds: dict[str, int] = {}   # per topic: how many agreement rounds this process began
AGREE_TIMEOUT_S = 300.0


def is_primary() -> bool:
    """True on process 0 (the one that writes checkpoints and prints)."""
    return jax.process_index() == 0


def process_index() -> int:
    """This process's index in the job, 0..process_count()-1."""
    return jax.process_index()


def process_count() -> int:
    """The number of processes in the job."""
    return jax.process_count()


def require_job(who: str) -> None:
    """Raise when this process was started as one of several (launcher, srun, mpirun
    variables) but `jdp.initialize()` did not join it to the others.

    Without this every rank would train alone, each its own process 0. Called by every jdp
    entry point that needs the job; after the first pass it is one global read.
    """
    global _job_checked
    if _job_checked:
        return
    if not jax.distributed.is_initialized():
        launched = _launcher_variables(os.environ)
        if launched:
            raise RuntimeError(
                f"{who}: this process runs under a launcher ({launched}) but jdp.initialize() "
                "was not called, so every rank would train alone: call jdp.initialize() first "
                "in main")
    _job_checked = True


def _launcher_variables(env: Any) -> str:
    """The variables that make this a multi-process job, as text; '' for a single process."""
    try:
        if _init._plan(None, None, None, None, None, env) is None:
            return ""
    except ValueError:  # an incomplete or bad job description is still a job description
        pass
    names = [_env.WORLD_SIZE, _env.RANK, "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
             _env.CLUSTER_DETECTION]
    return ", ".join(f"{n}={env[n]}" for n in names if n in env) or "launcher variables"


def broadcast_from_primary(tree: Any) -> Any:
    """Return process 0's values of `tree` on every process, as numpy arrays, bit for bit.

    So every replica starts identical even when processes initialised with different seeds.
    Leaves must have the same structure, shapes and dtypes on every process: that is checked
    first, and a difference raises ValueError on every process naming the leaf and the
    processes. A single process gets its own values back without communication.
    """
    return broadcast(tree, "jdp.broadcast_from_primary")


def broadcast(tree: Any, who: str) -> Any:
    """`broadcast_from_primary` for the jdp entry point `who` (named in its errors).

    The leaves travel as their raw bytes (one uint8 buffer), since the collective underneath
    is a sum in the leaves' dtype that would lose 64-bit values without x64.
    """
    require_job(who)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    for path, x in flat:   # NumPy has no typed keys; jdp.broadcast and replicate unwrap them
        dtype = getattr(x, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            raise TypeError(f"{who}: leaf {jax.tree_util.keystr(path)} is a typed PRNG key "
                            f"({x.dtype}), which has no NumPy form: pass "
                            "jax.random.key_data(key) and wrap_key_data it back, or use "
                            "jdp.broadcast, which places keys as keys")
    host = [np.asarray(x) for _, x in flat]
    for (path, _), x in zip(flat, host, strict=True):
        if x.dtype.kind == "O":
            raise TypeError(f"{who}: leaf {jax.tree_util.keystr(path)} is a Python object "
                            f"({type(x.flat[0]).__name__ if x.size else 'object'}), not an "
                            "array or number; keep it out of the tree or make it an array")
    if jax.process_count() == 1:
        return jax.tree.unflatten(treedef, host)
    agree("broadcast", [(jax.tree_util.keystr(p), f"{x.dtype}{list(x.shape)}")
                        for (p, _), x in zip(flat, host, strict=True)], who,
          "every process must build the same tree (same model, same config)")
    raw = [np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in host]
    if sum(r.size for r in raw):
        got = np.array(multihost_utils.broadcast_one_to_all(np.concatenate(raw)))
        ends = np.cumsum([r.size for r in raw])
        raw = np.split(got, ends[:-1])
    out = [r.view(x.dtype).reshape(x.shape) for r, x in zip(raw, host, strict=True)]
    return jax.tree.unflatten(treedef, out)


def agree(topic: str, facts: Sequence[tuple[str, str]], who: str, fix: str,
          timeout_s: float = AGREE_TIMEOUT_S) -> None:
    """Raise on every process unless all processes passed the same `facts` (name, value).

    The n-th call for `topic` on one process meets the n-th call on the others. Each process
    publishes a hash of its facts and reads everyone's (timed); only on a difference are the
    facts themselves read, to name the first one that differs and the processes on each side.
    A process that waits at another agreement point, one this process has not begun, can never
    come here: that deadlock is named within about a second (see `_get`).
    """
    client = _init.coordination_client()
    if client is None or jax.process_count() == 1:
        return
    n = _rounds[topic] = _rounds.get(topic, 0) + 1
    me, count, prefix = jax.process_index(), jax.process_count(), f"jdp/agree/{topic}/{n}"
    text = json.dumps([list(f) for f in facts])
    client.key_value_set(f"{prefix}/facts/{me}", text)
    client.key_value_set(f"{prefix}/hash/{me}", hashlib.sha256(text.encode()).hexdigest())
    client.key_value_set(f"jdp/agree/at/{me}", json.dumps([topic, n, who]), allow_overwrite=True)
    here = _Point(topic, n, who, timeout_s)
    hashes = [_get(client, f"{prefix}/hash/{r}", here, r) for r in range(count)]
    if len(set(hashes)) == 1:
        return
    groups: dict[str, list[int]] = {}
    for rank, h in enumerate(hashes):
        groups.setdefault(h, []).append(rank)
    ranks_a, ranks_b = list(groups.values())[:2]
    other = [json.loads(_get(client, f"{prefix}/facts/{r[0]}", here, r[0]))
             for r in (ranks_a, ranks_b)]
    name, value_a, value_b = _first_difference(*other)
    raise ValueError(f"{who}: the processes disagree on {name}: {value_a} on process(es) "
                     f"{_ranks(ranks_a)} but {value_b} on process(es) {_ranks(ranks_b)}; {fix}")


class _Point(NamedTuple):
    """An agreement point: the n-th call for `topic`, made by `who`."""
    topic: str
    n: int
    who: str
    timeout_s: float


def _get(client: Any, key: str, here: _Point, rank: int) -> str:
    """Process `rank`'s value of `key`, polled each second; between polls, a `rank` waiting at
    a point this process has not begun is a deadlock, raised at once."""
    deadline = time.monotonic() + here.timeout_s
    while True:
        wait = max(1, min(1000, int((deadline - time.monotonic()) * 1000)))
        try:
            return client.blocking_key_value_get(key, wait)
        except jax.errors.JaxRuntimeError as e:
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
        me = jax.process_index()
        try:
            topic, n, who = json.loads(client.key_value_try_get(f"jdp/agree/at/{rank}"))
        except jax.errors.JaxRuntimeError:  # not found: it has waited at no agreement point
            topic, n, who = None, 0, None
        if topic is not None and _rounds.get(topic, 0) < n:
            raise RuntimeError(
                f"{here.who}: process {me} waits here (call {here.n}) while process {rank} waits "
                f"in {who} (call {n}), which process {me} has not reached: the processes took "
                "different paths through the program; make every process make the same jdp "
                "calls in the same order")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{here.who}: process {rank} did not reach this call within "
                               f"{here.timeout_s:g} s (process {me} waited): it is slow, stuck, "
                               "dead or takes another path through the program")


def _first_difference(a: list, b: list) -> tuple[str, str, str]:
    """(name, value in a, value in b) of the first fact that differs ('absent' if missing)."""
    da, db = dict(map(tuple, a)), dict(map(tuple, b))
    for name in [k for k, _ in a] + [k for k, _ in b]:
        if da.get(name) != db.get(name):
            return name or "<root>", da.get(name, "absent"), db.get(name, "absent")
    return "the order of the leaves", str([k for k, _ in a][:4]), str([k for k, _ in b][:4])


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
