"""torchft's Lighthouse, the process that decides each step's quorum of replica groups.

`jdp.launch --ft_lighthouse start` runs one inside the launcher of the group it is given to;
`python -m jdp.ft.lighthouse --port 29510` runs one alone (a Kubernetes Deployment, a SLURM
job step). Replica groups find it through `JDP_FT_LIGHTHOUSE` (`http://host:port`).

The timings are jdp's choice for steps of seconds or less: a group that stops heartbeating
for `HEARTBEAT_TIMEOUT_MS` leaves the quorum, so a survivor's stall after a kill is about
that long; a quorum waits at most `JOIN_TIMEOUT_MS` for a heartbeating group that has not
asked for it yet.
"""
from __future__ import annotations

import argparse
import socket
import time

from jdp.job import values

DEFAULT_PORT = 29510
HEARTBEAT_TIMEOUT_MS = 1000
JOIN_TIMEOUT_MS = 2000
QUORUM_TICK_MS = 20


def server_class():
    """torchft's `LighthouseServer`, or an ImportError naming the extra to install."""
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as e:
        raise ImportError("jdp.ft needs torchft: pip install 'jdp[ft]' (torchft and the CPU "
                          f"build of torch) ({e})") from e
    return LighthouseServer


def start(port: int = DEFAULT_PORT, min_replicas: int = 1):
    """Start a Lighthouse on every interface at `port` (0: a free one); keep the returned
    server referenced (it stops when collected, or at `.shutdown()`)."""
    who = "jdp.ft.lighthouse.start"
    port = values.integer(who, "port", port, minimum=0, maximum=65535, fix="0 picks a free one")
    min_replicas = values.integer(who, "min_replicas", min_replicas, minimum=1,
                                  fix="the replica groups a quorum needs at least")
    return server_class()(bind=f"[::]:{port}", min_replicas=min_replicas,
                          join_timeout_ms=JOIN_TIMEOUT_MS, quorum_tick_ms=QUORUM_TICK_MS,
                          heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)


def address(server, host: str | None = None) -> str:
    """The address replica groups use: `http://HOST:PORT`, HOST this machine's name unless
    given (the server's own address names the host it resolved)."""
    port = server.address().rsplit(":", 1)[1]
    return f"http://{host or socket.gethostname()}:{port}"


def main(argv: list[str] | None = None) -> None:
    """`python -m jdp.ft.lighthouse [--port P] [--min_replicas N]`: serve until killed."""
    parser = argparse.ArgumentParser(prog="python -m jdp.ft.lighthouse", description=__doc__)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--min_replicas", type=int, default=1)
    args = parser.parse_args(argv)
    try:   # a bad value exits 2 with one line, as the launcher's options do
        values.integer("", "--port", args.port, minimum=0, maximum=65535)
        values.integer("", "--min_replicas", args.min_replicas, minimum=1)
    except ValueError as e:
        parser.error(str(e))
    server = start(args.port, args.min_replicas)
    print(f"jdp.ft: Lighthouse at {address(server)}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
