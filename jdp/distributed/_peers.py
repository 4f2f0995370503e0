"""Naming a lost process: the roll call's connections stay open while the job runs.

Outside jdp's launcher nobody watches the ranks, and a survivor learns of a dead peer only
from its collective (`Gloo all-reduce failed: Connection reset by peer`, or a SIGABRT with a
C++ stack when process 0 is gone), which names no rank. Process 0 keeps one connection to
every other process (`_rendezvous`); a process that leaves cleanly says goodbye first (at
exit, or in `jdp.shutdown()`). A connection that closes without a goodbye is a lost process:
process 0 names it and tells the others, a process that loses process 0 names process 0. The
survivor prints the name at once, adds it to the error its main thread raises, and ends with
exit code 1 within `GRACE_S` seconds unless that error ended it first: a collective that
hangs on a dead peer (NCCL) cannot keep it alive.
"""
from __future__ import annotations

import atexit
import queue
import re
import socket
import sys
import threading
import time

from jdp.job import net as _net
from jdp.job import run as _run

GRACE_S = 3.0        # time the main thread gets to fail by itself after a loss is known
# TCP keepalive on the connections (idle s, interval s, probes): a node that vanishes without
# closing them (power loss, a partition) is noticed after about 5 + 2 * 3 = 11 s.
KEEPALIVE = (5, 2, 3)
_LOST = threading.Event()   # set once a process is lost
_lost: list[str] = []       # the message naming the lost process, once one is lost
_conns: dict = {}           # rank -> connection (process 0: all others; else: process 0)
_ECHO = re.compile(r"gloo|nccl|connection (closed|reset) by peer|coordination service", re.I)


def watch(conns: dict, me: int) -> None:
    """Watch the roll call's connections `conns` ({rank: socket}) of process `me`."""
    _conns.update(conns)
    events: queue.Queue = queue.Queue()
    for rank, conn in conns.items():
        conn.settimeout(None)
        _keepalive(conn)
        threading.Thread(target=_net.receive, args=(conn, events, rank), daemon=True,
                         name=f"jdp-peer-{rank}").start()
    threading.Thread(target=_judge, args=(events, me), daemon=True, name="jdp-peers").start()
    atexit.register(goodbye)


def _keepalive(conn: socket.socket) -> None:
    """Probe an idle connection so a silent peer counts as lost (Linux options where known)."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE,
                           strict=True):
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def goodbye() -> None:
    """Tell the peers this process leaves cleanly (not lost); safe to call twice."""
    while _conns:
        _, conn = _conns.popitem()
        try:
            _net.send(conn, {"bye": True})
        except OSError:
            pass


def lost(error: BaseException | None = None) -> str | None:
    """The message naming the lost process, or None while none is lost. Given the `error`
    the main thread fails with, waits up to a second when it looks like a lost peer's echo
    (its connection and the failed collective break at the same moment)."""
    if error is not None and _conns and _ECHO.search(str(error)):
        _LOST.wait(1.0)
    return _lost[0] if _lost else None


def _judge(events: queue.Queue, me: int) -> None:
    """Read the peers' messages until one is lost (or every peer said goodbye)."""
    left = set(_conns)
    while left:
        rank, message = events.get()
        if message is None and rank in left and rank in _conns:
            return _lose(rank, me, "its connection closed without leaving the job")
        if message is None or message.get("bye"):
            left.discard(rank)
        elif "lost" in message:
            return _lose(message["lost"], me, "reported by process 0")


def _lose(rank: int, me: int, how: str) -> None:
    """Name the lost process, pass it on (process 0), and end this process after GRACE_S."""
    text = (f"jdp: process {me} lost process {rank} of the job ({how}: it was killed, crashed "
            f"or lost its node); process {me} stops too")
    _lost.append(text)
    _LOST.set()
    print(text, file=sys.stderr, flush=True)
    for conn in list(_conns.values()) if me == 0 else ():
        try:
            _net.send(conn, {"lost": rank})
        except OSError:
            pass
    time.sleep(GRACE_S)
    _run.exit_now(1)
