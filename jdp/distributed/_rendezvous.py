"""A roll call of a job's processes before JAX's own join, so a missing one is named.

When some process never shows up, `jax.distributed.initialize` ends process 0 with SIGABRT and
a C++ stack dump after its timeout, naming nobody. So every process first reports to process 0
on the coordinator port itself, before JAX's coordinator listens there, in jdp's own wire
format (`jdp.launch._net`: {"rank": k}, answered by {"go": true} once all have reported);
process 0 raises TimeoutError naming the processes that did not. The port is then handed to
JAX's coordinator (whose clients retry until it listens).
"""
from __future__ import annotations

import functools
import time

from jdp.launch import _net, _waiting

_HELLO_S = 2.0          # how long a connection may take to say which process it is


def gather(host: str, port: int, world: int, timeout_s: float) -> None:
    """Process 0: wait until processes 1..world-1 have reported, then let them all go;
    TimeoutError naming the processes that did not report within `timeout_s`."""
    joined: dict = {}
    deadline = time.monotonic() + timeout_s
    waiting = functools.partial(_gather_message, host, port, world, joined, timeout_s)
    with _waiting.announced(waiting), _net.listen(host, port, world + 8) as server:
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
    0 did not answer within `timeout_s`); saying so while it waits."""
    address = _net.join_host_port(host, port)
    with _waiting.announced(lambda waited: (
            f"jdp: process {rank} waits for process 0 at {address} to answer (all processes "
            f"to report there): {_waiting.seconds(waited)} of at most {timeout_s:g} s "
            "(JDP_INIT_TIMEOUT)")):
        _report(host, port, rank, timeout_s)


def _report(host: str, port: int, rank: int, timeout_s: float) -> None:
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


def _gather_message(host: str, port: int, world: int, joined: dict, timeout_s: float,
                    waited: float) -> str:
    missing = [r for r in range(1, world) if r not in joined]
    shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
    return (f"jdp: process 0 waits at {_net.join_host_port(host, port)} for process(es) {shown} "
            f"of {world} to report: {_waiting.seconds(waited)} of at most {timeout_s:g} s "
            "(JDP_INIT_TIMEOUT)")


def _missing_message(host: str, port: int, world: int, joined: dict, timeout_s: float) -> str:
    missing = [r for r in range(1, world) if r not in joined]
    shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
    return (f"process 0 waited {timeout_s:g} s at {_net.join_host_port(host, port)} for all "
            f"{world} processes; process(es) {shown} never reported. Start every rank with the "
            "same MASTER_ADDR, MASTER_PORT and WORLD_SIZE (or raise JDP_INIT_TIMEOUT)")
