"""A roll call of a job's processes before JAX's own join, so a missing one is named.

When some process never shows up, `jax.distributed.initialize` ends process 0 with SIGABRT and
a C++ stack dump after its timeout, naming nobody. So every process first reports to process 0
on the coordinator port itself, before JAX's coordinator listens there, in jdp's own wire
format (`jdp.job.net`: {"rank": k}, answered by {"go": true} once all have reported);
process 0 raises TimeoutError naming the processes that did not. Each report carries the
process count that process was started with: a different one is refused on both sides, naming
the process and both counts; so is a second report of a rank whose first reporter is still
connected (two processes started with the same RANK). The port is then handed to JAX's
coordinator (whose clients retry until it listens); the roll call's connections stay open, for
`_peers` to notice a lost process.

Cost: one connection and two small messages per process; process 0 holds the N - 1
connections for the whole job (it raises its open-file limit to fit): N file descriptors
there, one on every other process, and no traffic after the roll call but a goodbye at exit.
"""
from __future__ import annotations

import functools
import socket
import time

from jdp.job import net as _net
from jdp.job import waiting as _waiting

try:
    import resource
except ImportError:   # not on Windows: there the open-file limit stays as it is
    resource = None

_HELLO_S = 2.0          # how long a connection may take to say which process it is


def roll_call(host: str, port: int, rank: int, world: int,
              timeout_s: float) -> tuple[dict, int]:
    """Every process reports to process 0 before JAX's join; ({rank: open connection}, the
    whole seconds left of `timeout_s` (at least 1), for the join itself)."""
    start = time.monotonic()
    if rank == 0:
        conns = gather(host, port, world, timeout_s)
    else:
        conns = {0: report(host, port, rank, world, timeout_s)}
    return conns, max(1, int(timeout_s - (time.monotonic() - start) + 0.999))


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


def gather(host: str, port: int, world: int, timeout_s: float) -> dict:
    """Process 0: wait until processes 1..world-1 have reported, then let them all go and
    return their connections {rank: socket}; TimeoutError naming the processes that did not
    report within `timeout_s`, ValueError (on every side) for one started with another count,
    or for two processes that report the same rank."""
    joined: dict = {}
    kept = False
    deadline = time.monotonic() + timeout_s
    _room_for(world)
    waiting = functools.partial(_gather_message, host, port, world, joined, timeout_s)
    with _waiting.announced(waiting), _net.listen(host, port, world + 8) as server:
        try:
            while len(joined) < world - 1 or _closed_dropped(joined):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(_missing_message(host, port, world, joined, timeout_s))
                server.settimeout(min(left, 1.0))
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                hello = _net.receive_one(conn, _HELLO_S) or {}
                rank = hello.get("rank")
                if hello.get("world", world) != world:
                    _refuse(conn, joined, _mismatch(rank, hello["world"], world))
                if rank == 0:   # a second process 0 found the port taken (`second_zero`)
                    _refuse(conn, joined, _duplicate(0, world))
                if not isinstance(rank, int) or not 0 < rank < world:
                    conn.close()
                    continue
                if rank in joined and _open(joined[rank]):
                    _refuse(conn, joined, _duplicate(rank, world))
                if rank in joined:
                    joined[rank].close()   # a restarted process reports again
                joined[rank] = conn
            for conn in joined.values():
                _net.send(conn, {"go": True})
            kept = True
            return joined
        finally:
            for conn in joined.values() if not kept else ():
                conn.close()


def report(host: str, port: int, rank: int, world: int, timeout_s: float):
    """Process `rank` > 0: report to process 0 and wait for its "go"; the connection, kept
    open. TimeoutError if process 0 did not answer within `timeout_s`, ValueError when it
    refused this process (another process count)."""
    address = _net.join_host_port(host, port)
    with _waiting.announced(lambda waited: (
            f"jdp: process {rank} waits for process 0 at {address} to answer (all processes "
            f"to report there): {_waiting.seconds(waited)} of at most {round(timeout_s)} s "
            "(JDP_INIT_TIMEOUT)")):
        return _report(host, port, rank, world, timeout_s)


def second_zero(host: str, port: int, world: int) -> None:
    """A process 0 that finds the coordinator port taken asks the taker whether it is this
    job's process 0: if so, both raise ValueError naming RANK=0 twice; else nothing (the port
    is simply busy)."""
    try:
        _report(host, port, 0, world, _HELLO_S).close()
    except TimeoutError:
        pass


def _report(host: str, port: int, rank: int, world: int, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    # by the deadline: a listener that takes connections and never answers (a port held by
    # another server) would otherwise be asked again until its backlog fills
    while ((left := deadline - time.monotonic()) > 0
           and (conn := _net.connect(host, port, left)) is not None):
        try:
            _net.send(conn, {"rank": rank, "world": world})
            answer = _net.receive_one(conn, deadline - time.monotonic())
        except OSError:
            answer = None
        if answer == {"go": True}:
            return conn
        conn.close()
        if answer and "refused" in answer:
            raise ValueError(answer["refused"])
        time.sleep(0.1)
    raise TimeoutError(
        f"process {rank} could not reach the coordinator at {_net.join_host_port(host, port)} "
        f"within {timeout_s:g} s; check that process 0 runs and that MASTER_ADDR/MASTER_PORT "
        "name its address and port (or raise JDP_INIT_TIMEOUT)")


def _mismatch(rank, theirs, world: int) -> str:
    return (f"process {rank} was started for a job of {theirs} processes but process 0 for "
            f"{world} (WORLD_SIZE / the process count differs); start every process with the "
            "same number of processes")


def _duplicate(rank: int, world: int) -> str:
    return (f"two processes were started with RANK={rank}: process 0 heard from both, while "
            f"the job's {world} processes need RANK 0..{world - 1}, each once; give each "
            "process its own RANK")


def _open(conn) -> bool:
    """Is the process at the other end of `conn` still there? A process that reported and
    was restarted closed its connection (end of stream); a second one with its RANK did not."""
    timeout = conn.gettimeout()
    conn.setblocking(False)
    try:
        return conn.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        conn.settimeout(timeout)


def _closed_dropped(joined: dict) -> bool:
    """Drop the processes that reported and then ended (a restart reports again): True when
    there were any, so that the "go" waits for their successors."""
    closed = [rank for rank, conn in joined.items() if not _open(conn)]
    for rank in closed:
        joined.pop(rank).close()
    return bool(closed)


def _refuse(conn, joined: dict, message: str):
    """Tell the refused process and those already reported why, then raise it here."""
    for other in (conn, *joined.values()):
        try:
            _net.send(other, {"refused": message})
        except OSError:
            pass
    conn.close()
    raise ValueError(message)


def _gather_message(host: str, port: int, world: int, joined: dict, timeout_s: float,
                    waited: float) -> str:
    missing = [r for r in range(1, world) if r not in joined]
    shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
    return (f"jdp: process 0 waits at {_net.join_host_port(host, port)} for process(es) {shown} "
            f"of {world} to report: {_waiting.seconds(waited)} of at most {round(timeout_s)} s "
            "(JDP_INIT_TIMEOUT)")


def _missing_message(host: str, port: int, world: int, joined: dict, timeout_s: float) -> str:
    missing = [r for r in range(1, world) if r not in joined]
    shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
    return (f"process 0 waited {timeout_s:g} s at {_net.join_host_port(host, port)} for all "
            f"{world} processes; process(es) {shown} never reported. Start every rank with the "
            "same MASTER_ADDR, MASTER_PORT and WORLD_SIZE (or raise JDP_INIT_TIMEOUT)")
