"""TCP for the launcher and `initialize`: port checks, and jdp's wire format (JSON lines).

JAX handles a bad coordinator port badly: a port that is already taken makes process 0 die
with SIGSEGV, and an unreachable coordinator makes the other processes abort (SIGABRT) with a
C++ stack dump. jdp checks the port itself first, so the user gets a one-line error instead.
"""
from __future__ import annotations

import errno
import json
import os
import queue
import socket
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now (the OS picks it)."""
    family, sockaddr = resolve(host, 0)
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind(sockaddr)
        return s.getsockname()[1]


def join_host_port(host: str, port: int) -> str:
    """`host:port` as gRPC wants it: IPv6 literals go in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def port_problem(host: str, port: int, what: str = "MASTER_PORT",
                 settle_s: float = 2.0) -> str | None:
    """Why the coordinator could not listen on `host:port` here (a one-line message naming
    the setting `what` and the fix), or None if it could.

    The test is a real bind with SO_REUSEADDR (as gRPC does), so ports in TIME_WAIT count as
    free but a port with a listener does not. A port found in use is tried again for
    `settle_s` seconds: an outgoing connection may hold it for a moment as its source port
    (connect() draws from the same range as the ports the OS hands out).
    """
    try:
        family, sockaddr = resolve(host, port)
    except OSError as e:
        return (f"MASTER_ADDR={host!r} does not resolve ({e}); set it to an address or host "
                "name of the machine that runs process 0")
    deadline = time.monotonic() + settle_s
    while (code := _bind_error(family, sockaddr)) == errno.EADDRINUSE and (
            time.monotonic() < deadline):
        time.sleep(0.1)
    if code is None:
        return None
    if code == errno.EADDRINUSE:
        return (f"{what}={port} is already in use on {host}; choose a free port (or "
                "leave it out on a single node to get one) or stop the process holding it")
    if code == errno.EADDRNOTAVAIL:
        return (f"MASTER_ADDR={host!r} is not an address of this machine, but process 0 "
                "runs here and must listen on it; use this machine's address")
    return (f"cannot listen on {join_host_port(host, port)} ({os.strerror(code)}); choose "
            f"another {what}")


def _bind_error(family: int, sockaddr: tuple) -> int | None:
    """The errno of binding a listening-style socket to `sockaddr`, or None if it binds."""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as e:
            return e.errno or -1
    return None


def resolves(host: str) -> bool:
    """Does `host` (a name or an address) resolve to a TCP address?"""
    try:
        resolve(host, 0)
    except (OSError, UnicodeError):
        return False
    return True


def split_host_port(address: str) -> tuple[str, int]:
    """("host", port) from "host:port" / "[v6]:port" (the inverse of join_host_port);
    ValueError naming `address` when it is not of that form with a port in 1..65535."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator address {address!r} is not 'host:port' with a port in "
                         "1..65535; set MASTER_ADDR and MASTER_PORT (e.g. 127.0.0.1 and 29500)")
    return host.strip("[]"), int(port)


def resolve(host: str, port: int) -> tuple[int, tuple]:
    """(address family, sockaddr) of the first TCP address of `host`."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host.strip("[]"), port,
                                                   type=socket.SOCK_STREAM)[0]
    return family, sockaddr


# jdp's own wire format (the launchers' rounds, initialize's roll call): JSON lines over TCP.

def send(conn: socket.socket, message: dict) -> None:
    """Send one message as a line of JSON."""
    conn.sendall((json.dumps(message) + "\n").encode())


def receive(conn: socket.socket, out: queue.Queue, tag: object = None) -> None:
    """Put every message read from `conn` into `out` as (tag, message), then (tag, None) once
    the connection closes or breaks (meant for a thread of its own)."""
    buffer = b""
    try:
        while chunk := conn.recv(65536):
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                out.put((tag, json.loads(line)))
    except (OSError, ValueError):
        pass
    out.put((tag, None))


def listen(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP server socket bound to `host:port` (SO_REUSEADDR) and listening."""
    family, sockaddr = resolve(host, port)
    server = socket.socket(family, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(sockaddr)
    server.listen(backlog)
    return server


def connect(host: str, port: int, timeout_s: float) -> socket.socket | None:
    """A connection to `host:port`, retried until it succeeds or `timeout_s` passes (None)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            conn = socket.create_connection((host, port), timeout=max(0.05, min(left, 2.0)))
            if conn.getsockname() != conn.getpeername():
                return conn
            conn.close()   # TCP connected this socket to itself: nobody listens there yet
        except OSError:
            pass
        if time.monotonic() + 0.1 >= deadline:
            return None
        time.sleep(0.1)


def receive_one(conn: socket.socket, timeout_s: float) -> dict | None:
    """The next message on `conn`, or None when none arrives whole within `timeout_s`."""
    conn.settimeout(max(0.05, timeout_s))
    try:
        with conn.makefile("rb") as stream:
            return json.loads(stream.readline(65536))
    except (OSError, ValueError):
        return None
