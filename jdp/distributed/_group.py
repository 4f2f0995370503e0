"""Who this process is in the job, process 0's values for everyone, and checks that the
processes agree before a collective that would otherwise hang or mix their values.

Agreement goes through the coordination service's key-value store (timed gets, O(1) requests
per process: `_agree`), never a device collective: a process that disagrees, or never comes,
turns into an error on every process, naming what differs and where, instead of a hang.
"""
from __future__ import annotations

import collections
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jdp.distributed import _agree, _init
from jdp.job import env as _env
from jdp.job import rank as _rank
from jdp.job import run as _run

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
    agreement = _rank.current().agreement
    if agreement.job_checked:
        return
    if not jax.distributed.is_initialized():
        launched = _launcher_variables(os.environ)
        if launched:
            raise RuntimeError(
                f"{who}: this process runs under a launcher ({launched}) but jdp.initialize() "
                "was not called, so every rank would train alone: call jdp.initialize() first "
                "in main")
    if jax.distributed.is_initialized():
        _same_devices_everywhere(who)
    agreement.job_checked = True


def _same_devices_everywhere(who: str) -> None:
    """Every process must hold as many devices as the others: the data mesh and the batches
    split alike over them. Read from the global device list, so it needs no message."""
    counts = collections.Counter(d.process_index for d in jax.devices())
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"process {p} has {n}" for p, n in sorted(counts.items())[:4])
        raise _run.shared(ValueError(
            f"{who}: the processes hold different numbers of devices ({shown}"
            f"{', ...' if len(counts) > 4 else ''}); start each with the same count "
            "(jdp.launch --devices_per_process, CUDA_VISIBLE_DEVICES)"))


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
    return broadcast_for(tree, "jdp.broadcast_from_primary")


def broadcast_for(tree: Any, who: str) -> Any:
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
    makes a constant number of requests to the coordination service whatever the number of
    processes, and the keys of a finished point are deleted (`_agree`). A difference names
    the first fact that differs and the processes on each side (ValueError); a process that
    waits at another agreement point, one this process has not begun, can never come here:
    that deadlock is named within about a second (RuntimeError).
    """
    client = _init.coordination_client()
    if client is None or jax.process_count() == 1:
        return
    rank = _rank.current()
    peers, rounds = rank.peers, rank.agreement.rounds
    me = _agree.Process(jax.process_index(), jax.process_count(), rounds,
                        peers if peers.conns else None)
    peers.waiting = (who, rounds.get(topic, 0) + 1)
    before = (rank.progress.current() or (0, -1, "start"))[2]
    _rank.record("wait")   # the launcher's watchdog and goodput see the wait, not start-up
    try:
        _agree.agree_in_store(client, me, topic, facts, who, fix, timeout_s)
    finally:
        peers.waiting = None
        _rank.record(before)   # the call goes on in its own phase (a save: "checkpoint")


def barrier(name: str = "jdp.barrier", timeout_s: float = AGREE_TIMEOUT_S) -> None:
    """Wait until every process reaches the barrier `name`, or raise.

    Unlike a device collective it cannot hang forever: it is an agreement point (`agree`), so
    processes at barriers of different names are named at once (ValueError), a process whose
    script ended, or that went on past the barrier, is named within seconds (RuntimeError),
    and one that never comes after `timeout_s` (TimeoutError). All processes must pass the
    same names in the same order. A single process returns at once, once its arguments
    passed the checks every process makes (`jdp.job.values`), so a mistake shows alone too.

    Args:
        name: the barrier's id (a str); the same name may be used again once all have passed.
        timeout_s: seconds to wait for the slowest process: finite, > 0, at most a week.

    Example:
        >>> import jdp
        >>> if jdp.is_primary():
        ...     print("preparing the dataset")   # one process writes, the others wait
        preparing the dataset
        >>> jdp.barrier("dataset-ready", timeout_s=60)
    """
    from jdp.job import values
    if not isinstance(name, str):   # checked on one process too, as on many
        raise values.wrong_type("jdp.barrier", "name", name, "a str", "the barrier's id")
    timeout_s = values.seconds("jdp.barrier", "timeout_s", timeout_s, maximum=_env.MAX_SECONDS,
                               fix="the seconds to wait for the slowest process")
    agree("barrier", [("name", name)], f"jdp.barrier({name!r})",
          "every process must pass the same barriers in the same order", timeout_s)
