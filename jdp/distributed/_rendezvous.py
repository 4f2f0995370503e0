"""A plain TCP roll call of a job's processes before JAX's own join.

Why: when some process never shows up, JAX's `jax.distributed.initialize` ends process 0 with
SIGABRT and a C++ stack dump after its timeout, naming nobody. jdp first has every process
report to process 0 on the coordinator port itself (before JAX's coordinator listens there):
process 0 answers "go" once all have reported, or raises TimeoutError naming the processes
that did not. The port is then handed to JAX's coordinator (whose clients retry until it
listens). Standard library only.
"""
from __future__ import annotations

import socket
import time

from jdp.launch import _net

HELLO = b"jdp-join "
GO = b"go\n"
_READ_S = 2.0          # how long a connection may take to say which process it is


def gather(host: str, port: int, world: int, timeout_s: float) -> None:
    """Process 0: wait until processes 1..world-1 have reported, then let them all go.

    Raises:
        TimeoutError: naming the processes that did not report within `timeout_s`.
    """
    family, sockaddr = _net.resolve(host, port)
    joined: dict = {}
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(sockaddr)
        server.listen(world + 8)
        deadline = time.monotonic() + timeout_s
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
                rank = _read_hello(conn)
                if rank is None or not 0 < rank < world:
                    conn.close()
                    continue
                if rank in joined:
                    joined[rank].close()   # a restarted process reports again
                joined[rank] = conn
            for conn in joined.values():
                conn.sendall(GO)
        finally:
            for conn in joined.values():
                conn.close()


def report(host: str, port: int, rank: int, timeout_s: float) -> None:
    """Process `rank` > 0: report to process 0 and wait for its "go".

    Raises:
        TimeoutError: process 0 did not answer within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"process {rank} could not reach the coordinator at "
                f"{_net.join_host_port(host, port)} within {timeout_s:g} s; check that process "
                "0 runs and that MASTER_ADDR/MASTER_PORT name its address and port (or raise "
                "JDP_INIT_TIMEOUT)")
        try:
            with socket.create_connection((host, port), timeout=min(left, 2.0)) as conn:
                conn.sendall(HELLO + str(rank).encode() + b"\n")
                conn.settimeout(max(0.05, deadline - time.monotonic()))
                if conn.recv(len(GO)) == GO:
                    return
        except OSError:
            pass
        time.sleep(0.1)


def _read_hello(conn: socket.socket) -> int | None:
    """The rank a new connection reports, or None for anything else."""
    conn.settimeout(_READ_S)
    data = b""
    try:
        while not data.endswith(b"\n") and len(data) < 64:
            chunk = conn.recv(64)
            if not chunk:
                break
            data += chunk
    except OSError:
        return None
    if not data.startswith(HELLO):
        return None
    try:
        return int(data[len(HELLO):].strip())
    except ValueError:
        return None


def _missing_message(host: str, port: int, world: int, joined: dict, timeout_s: float) -> str:
    missing = [r for r in range(1, world) if r not in joined]
    shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
    return (f"process 0 waited {timeout_s:g} s at {_net.join_host_port(host, port)} for all "
            f"{world} processes; process(es) {shown} never reported. Start every rank with the "
            "same MASTER_ADDR, MASTER_PORT and WORLD_SIZE (or raise JDP_INIT_TIMEOUT)")
