"""Job-wide rounds across nodes: node 0's launcher decides when every node starts and stops.

With `--nnodes M` each node's launcher starts only its own ranks, but a failure anywhere must
stop and restart the ranks of *every* node together (a half-restarted job ends in JAX's
"different incarnation" aborts). So node 0's launcher also runs a small TCP server (the
*round keeper*, on MASTER_ADDR at --rdzv_port, default MASTER_PORT+1) and every launcher,
node 0's included, is its client over one connection of JSON lines:

    launcher -> keeper   {"node": k}                        once, on connecting
    keeper -> launchers  {"start": r, "failure": F|null}    start round r (F: why, r > 0)
    launcher -> keeper   {"end": r, "how": "ok"|"failed"|"stopped"|"signal", "failure": F}
    keeper -> launchers  {"stop": r, "failure": F}          the first failure of round r
    keeper -> launchers  {"exit": status, "failure": F}     the job is over

F = {"rank", "node", "returncode", "tail", "seconds"} of the first rank to fail in the round
(a launcher that vanishes counts as a failure of its node). After a failed round the keeper
waits a short backoff and starts round r+1 (JDP_RESTART_COUNT=r) while restarts are left.
"""
from __future__ import annotations

import json
import queue
import signal
import socket
import threading
import time

from jdp.launch import _exit, _net

BACKOFF_S = 1.0
JOIN_TIMEOUT_S = 300.0


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


def _lines(conn: socket.socket, out: queue.Queue, tag) -> None:
    """Put every JSON line read from `conn` into `out` as (tag, message); (tag, None) at EOF."""
    buffer = b""
    try:
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                out.put((tag, json.loads(line)))
    except (OSError, ValueError):
        pass
    out.put((tag, None))


class Keeper:
    """Node 0's round keeper: a thread that runs the rounds of the whole job."""

    def __init__(self, host: str, port: int, nnodes: int, max_restarts: int):
        self.nnodes, self.max_restarts = nnodes, max_restarts
        family, sockaddr = _net.resolve(host, port)
        self.server = socket.socket(family, socket.SOCK_STREAM)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(sockaddr)
        self.server.listen(nnodes + 4)
        self.events: queue.Queue = queue.Queue()
        self.nodes: dict = {}
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._run, daemon=True).start()

    def close(self) -> None:
        self.server.close()

    def _accept(self) -> None:
        """Take connections; each one's lines go to self.events tagged with its socket."""
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=_lines, args=(conn, self.events, conn), daemon=True).start()

    def _run(self) -> None:
        """Rounds until one ends without failure, or restarts run out."""
        failure = None
        try:
            for r in range(self.max_restarts + 1):
                self._await_nodes()
                self._broadcast({"start": r, "failure": failure})
                how, failure = self._round(r)
                if failure is None or r == self.max_restarts or how == "signal":
                    break
                time.sleep(BACKOFF_S)
            self._broadcast({"exit": _status(failure), "failure": failure})
        except TimeoutError as e:
            self._broadcast({"exit": 1, "failure": {"error": str(e)}})

    def _await_nodes(self) -> None:
        """Wait until every node's launcher is connected (new ones after a node loss)."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while len(self.nodes) < self.nnodes:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.nnodes)) - set(self.nodes))
                raise TimeoutError(f"node(s) {missing} did not connect within "
                                   f"{JOIN_TIMEOUT_S:g} s")
            try:
                conn, message = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if message is not None and "node" in message:
                self.nodes[message["node"]] = conn
            elif message is None:
                self._forget(conn)

    def _round(self, r: int) -> tuple:
        """Collect every node's end of round r; stop all at the first failure."""
        ended: dict = {}
        failure, how = None, "ok"
        while len(ended) < self.nnodes:
            conn, message = self.events.get()
            node = next((k for k, c in self.nodes.items() if c is conn), None)
            if message is None:
                if node is not None:
                    self._forget(conn)
                    ended[node] = "lost"
                    failure = failure or {"node": node, "lost": True}
                    self._broadcast({"stop": r, "failure": failure})
                continue
            if "node" in message:            # a launcher came back mid-round: next round
                self.nodes[message["node"]] = conn
                continue
            if message.get("end") != r or node is None:
                continue
            ended[node] = message["how"]
            if message["how"] == "failed" and failure is None:
                failure = message["failure"]
                self._broadcast({"stop": r, "failure": failure})
            elif message["how"] == "signal":
                how = "signal"
                failure = failure or message.get("failure")
        return how, failure

    def _forget(self, conn) -> None:
        for k, c in list(self.nodes.items()):
            if c is conn:
                del self.nodes[k]

    def _broadcast(self, message: dict) -> None:
        for conn in list(self.nodes.values()):
            try:
                _send(conn, message)
            except OSError:
                pass


def _status(failure: dict | None) -> int:
    """The job's exit status from the round's first failure (None: success)."""
    if failure is None:
        return 0
    if "signal" in failure:
        return 128 + failure["signal"]
    code = failure.get("returncode")
    if code is None:
        return 1
    return 128 - code if code < 0 else code


class Link:
    """One launcher's connection to the round keeper."""

    def __init__(self, host: str, port: int, node: int, timeout_s: float = JOIN_TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.conn = socket.create_connection((host, port), timeout=5.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"node {node} could not reach node 0's launcher at "
                        f"{_net.join_host_port(host, port)} within {timeout_s:g} s; start node "
                        "0 with the same --master_addr and --master_port (and --rdzv_port)"
                    ) from None
                time.sleep(0.2)
        self.conn.settimeout(None)
        self.node = node
        self.messages: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.stop_failure: dict | None = None
        _send(self.conn, {"node": node})
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        """Route the keeper's messages: "stop" sets self.stop at once, the rest are queued."""
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_lines, args=(self.conn, lines, None), daemon=True).start()
        while True:
            _, message = lines.get()
            if message is not None and "stop" in message:
                self.stop_failure = message["failure"]
                self.stop.set()
                continue
            self.messages.put(message)
            if message is None:
                self.stop_failure = {"node": 0, "lost": True}
                self.stop.set()
                return

    def next(self) -> dict:
        """The keeper's next "start" or "exit" (an "exit" if the keeper vanished)."""
        message = self.messages.get()
        if message is None:
            return {"exit": 1, "failure": {"node": 0, "lost": True}}
        self.stop.clear()
        return message

    def end(self, r: int, how: str, failure: dict | None) -> None:
        _send(self.conn, {"end": r, "how": how, "failure": failure})

    def close(self) -> None:
        self.conn.close()


def round_end(outcome, node: int, stall: str | None, stall_status: int) -> tuple:
    """How this node's round ended ("ok", "failed", "stopped", "signal"), and its failure F.

    `outcome` is the node's `_supervisor.Outcome`; `stall` the watchdog's report, if any.
    """
    if outcome.signal is not None:
        return "signal", {"node": node, "signal": outcome.signal}
    if outcome.stopped:
        return "stopped", None
    if stall is not None:
        return "failed", {"node": node, "returncode": stall_status, "seconds": outcome.seconds,
                          "stall": stall}
    if outcome.failed_rank is None:
        return "ok", None
    return "failed", {"node": node, "rank": outcome.failed_rank, "seconds": outcome.seconds,
                      "returncode": outcome.returncode, "tail": list(outcome.tail)}


def failure_report(failure: dict, who: str, nnodes: int, world: int) -> str:
    """The one summary every launcher prints about the first failure of a round."""
    if "error" in failure:
        return f"{who}: {failure['error']}"
    if failure.get("lost"):
        return (f"{who}: lost the launcher of node {failure['node']} (its connection closed); "
                "stopped the processes of every node.")
    if "signal" in failure:
        return (f"{who}: node {failure['node']}'s launcher received "
                f"{signal.Signals(failure['signal']).name}; every node stopped.")
    if "stall" in failure:
        return f"{failure['stall']}\n{who}: (node {failure['node']}) stopped all {world} processes."
    lines = [f"{who}: rank {failure['rank']} on node {failure['node']} failed with "
             f"{_exit.describe_exit(failure['returncode'])} after {failure['seconds']:.1f} s; "
             f"stopped all {world} processes on {nnodes} nodes."]
    tail = failure.get("tail") or []
    lines.append(f"{who}: last {len(tail)} line(s) of rank {failure['rank']}'s stderr:" if tail
                 else f"{who}: rank {failure['rank']} wrote nothing to stderr.")
    lines += [f"  {line}" for line in tail]
    return "\n".join(lines)
