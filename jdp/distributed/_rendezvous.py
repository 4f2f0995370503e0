"""A roll call of a job's processes before JAX's own join, so a missing one is named.

When some process never shows up, `jax.distributed.initialize` ends process 0 with SIGABRT and
a C++ stack dump after its timeout, naming nobody. So every process first reports to process 0
on the coordinator port itself, before JAX's coordinator listens there, in jdp's own wire
format (`jdp.job.net`: {"rank": k}, answered by {"go": true} once all have reported);
process 0 raises TimeoutError naming the processes that did not. The port is then handed to
JAX's coordinator (whose clients retry until it listens).

Cost: one connection and two small messages per process; process 0 holds the N - 1
connections until all have reported (it raises its open-file limit to fit), so N file
descriptors there for the roll call's few seconds, nothing afterwards.
"""
from __future__ import annotations

import time

from jdp.job import net as _net

try:
    import resource
except ImportError:   # not on Windows: there the open-file limit stays as it is
    resource = None

_HELLO_S = 2.0          # how long a connection may take to say which process it is


def roll_call(host: str, port: int, rank: int, world: int, timeout_s: float) -> int:
    """Every process reports to process 0 before JAX's join; the whole seconds left of
    `timeout_s` (at least 1), for the join itself."""
    start = time.monotonic()
    if rank == 0:
        gather(host, port, world, timeout_s)
    else:
        report(host, port, rank, timeout_s)
    return max(1, int(timeout_s - (time.monotonic() - start) + 0.999))


def _room_for(connections: int) -> None:
    """Raise this process's soft open-file limit towards the hard one when `connections`
    (and a margin for JAX's own files) would not fit: 1,024 is a common soft default."""
    if resource is None:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        top = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, top), hard))


def gather(host: str, port: int, world: int, timeout_s: float) -> None:
    """Process 0: wait until processes 1..world-1 have reported, then let them all go;
    TimeoutError naming the processes that did not report within `timeout_s`."""
    joined: dict = {}
    deadline = time.monotonic() + timeout_s
    _room_for(world)
    with _net.listen(host, port, world + 8) as server:
        try:
            while len(joined) < world - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(_missing_message(host, port, world, joined, timeout_s))
                server.settimeout(min(left, 1.0))
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                rank = (_net.receive_one(conn, _HELLO_S) or {}).get("rank")
                if not isinstance(rank, int) or not 0 < rank < world:
                    conn.close()
                    continue
                if rank in joined:
                    joined[rank].close()   # a restarted process reports again
                joined[rank] = conn
            for conn in joined.values():
                _net.send(conn, {"go": True})
        finally:
            for conn in joined.values():
                conn.close()


def report(host: str, port: int, rank: int, timeout_s: float) -> None:
    """Process `rank` > 0: report to process 0 and wait for its "go" (TimeoutError if process
    0 did not answer within `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while (conn := _net.connect(host, port, deadline - time.monotonic())) is not None:
        with conn:
            try:
                _net.send(conn, {"rank": rank})
            except OSError:
                continue
            if _net.receive_one(conn, deadline - time.monotonic()) == {"go": True}:
                return
        time.sleep(0.1)
    raise TimeoutError(
        f"process {rank} could not reach the coordinator at {_net.join_host_port(host, port)} "
        f"within {timeout_s:g} s; check that process 0 runs and that MASTER_ADDR/MASTER_PORT "
        "name its address and port (or raise JDP_INIT_TIMEOUT)")


def _missing_message(host: str, port: int, world: int, joined: dict, timeout_s: float) -> str:
    missing = [r for r in range(1, world) if r not in joined]
    shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
    return (f"process 0 waited {timeout_s:g} s at {_net.join_host_port(host, port)} for all "
            f"{world} processes; process(es) {shown} never reported. Start every rank with the "
            "same MASTER_ADDR, MASTER_PORT and WORLD_SIZE (or raise JDP_INIT_TIMEOUT)")
