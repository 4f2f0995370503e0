"""Rounds: the one way the launcher runs a job, on one node or on many.

A job runs in rounds. Round r starts the ranks of every node (JDP_RESTART_COUNT=r); the first
failure anywhere stops the round on every node at once (a half-restarted job would end in
JAX's "different incarnation" aborts); while restarts are left, every node starts round r+1
together (after a 1 s backoff with several nodes). Node 0's launcher keeps the rounds (the
*keeper*, a thread) and every launcher, node 0's included, is its client over one connection
of JSON lines: node 0's over a socket pair, the others' over TCP to MASTER_ADDR:--rdzv_port.

    launcher -> keeper   {"node": k}                                  once, on connecting
    keeper -> launchers  {"start": r, "report": text | null}          start round r
    launcher -> keeper   {"end": r, "state": S, "status": n, "report": text | null}
    keeper -> launchers  {"stop": r}                                  another node failed
    keeper -> launchers  {"exit": status, "report": text | null}      the job is over

S is an `_outcome.State` value; a round's report (the first failure's, formatted where it
happened) reaches every launcher with the next "start" or the "exit", so every node prints
the same summary once. A launcher that vanishes counts as a failure of its node; the next
round waits for a launcher of that node to connect.
"""
from __future__ import annotations

import queue
import socket
import sys
import threading
import time
from collections.abc import Callable

from jdp.launch import _net
from jdp.launch._outcome import Job, Outcome, State, exit_status, report

BACKOFF_S = 1.0
JOIN_TIMEOUT_S = 300.0
_ENDED = ("failed", "stalled", "lost")   # states that end the round on every node


def run(job: Job, max_restarts: int, rdzv: tuple | None,
        run_round: Callable[[int, threading.Event], Outcome]) -> int:
    """This node's part of the job: run the rounds the keeper starts; the exit status.

    Args:
        job: the job (its node, nnodes and world size).
        max_restarts: rounds after the first that a failure may start.
        rdzv: (host, port) of node 0's keeper when there are several nodes, else None.
        run_round: runs this node's ranks for round r until they end or the event is set.
    """
    keeper = Keeper(job.nnodes, max_restarts, rdzv) if job.node == 0 else None
    try:
        conn = keeper.connect_local() if keeper else _net.connect(*rdzv, JOIN_TIMEOUT_S)
        if conn is None:
            _say(f"{job.who}: node {job.node} could not reach node 0's launcher at "
                 f"{_net.join_host_port(*rdzv)} within {JOIN_TIMEOUT_S:g} s; start node 0 with "
                 "the same --master_addr and --master_port (and --rdzv_port)")
            return 1
        return _follow(Link(conn, job.node), job, max_restarts, run_round)
    finally:
        if keeper is not None:
            keeper.close()


def _follow(link: Link, job: Job, max_restarts: int, run_round: Callable) -> int:
    """Run each round the keeper starts; print its reports; return its exit status."""
    own_signal = None
    everyone = f"all {job.world} processes" + (f" of {job.nnodes} nodes" if job.nnodes > 1 else "")
    try:
        while True:
            message = link.next()
            if message.get("report"):
                _say(message["report"])
            if "exit" in message:
                return 128 + own_signal if own_signal else message["exit"]
            r = message["start"]
            if r > 0:
                _say(f"{job.who}: restart {r} of {max_restarts}: starting {everyone} again.")
            outcome = run_round(r, link.stop)
            if outcome.state is State.SIGNALED:
                own_signal = outcome.detail.signal
            link.send({"end": r, "state": outcome.state.value, "status": exit_status(outcome),
                       "report": report(outcome, job) or None})
    finally:
        link.conn.close()


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Keeper:
    """Node 0's round keeper: a thread that runs the rounds of the whole job."""

    def __init__(self, nnodes: int, max_restarts: int, address: tuple | None):
        self.nnodes, self.max_restarts = nnodes, max_restarts
        self.events: queue.Queue = queue.Queue()   # (connection, message or None at its end)
        self.nodes: dict = {}                      # node -> its launcher's connection
        self.server = None if address is None else _net.listen(*address, nnodes + 4)
        if self.server is not None:
            threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._run, daemon=True).start()

    def connect_local(self) -> socket.socket:
        """Node 0's own connection (a socket pair: no port needed on a single node)."""
        ours, theirs = socket.socketpair()
        self._watch(ours)
        return theirs

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def _watch(self, conn: socket.socket) -> None:
        threading.Thread(target=_net.receive, args=(conn, self.events, conn), daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self._watch(self.server.accept()[0])
            except OSError:
                return

    def _run(self) -> None:
        """Rounds until one ends without failure, on a signal, or when restarts run out."""
        first = None
        try:
            for r in range(self.max_restarts + 1):
                self._await_nodes()
                self._broadcast({"start": r, "report": first and first["report"]})
                first, signaled = self._round(r)
                if first is None or signaled or r == self.max_restarts:
                    break
                time.sleep(BACKOFF_S if self.nnodes > 1 else 0.0)   # every node's ranks gone
            self._broadcast({"exit": first["status"] if first else 0,
                             "report": first and first["report"]})
        except TimeoutError as e:
            self._broadcast({"exit": 1, "report": f"jdp.launch: {e}"})

    def _await_nodes(self) -> None:
        """Wait until every node's launcher is connected (new ones after a node loss)."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while len(self.nodes) < self.nnodes:
            try:
                conn, message = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(self.nnodes)) - set(self.nodes))
                raise TimeoutError(f"node(s) {missing} did not connect within "
                                   f"{JOIN_TIMEOUT_S:g} s") from None
            if message is None:
                self._forget(conn)
            elif "node" in message:
                self.nodes[message["node"]] = conn

    def _round(self, r: int) -> tuple:
        """Every node's end of round r: (the first failure's message or None, signaled?).

        The first failure stops the round on every node. A signal (preemption) does not: the
        ranks agree on a step, save and leave by themselves; it only ends the restarts.
        """
        ended, first, signaled = set(), None, None
        while len(ended) < self.nnodes:
            conn, message = self.events.get()
            node = next((k for k, c in self.nodes.items() if c is conn), None)
            if message is not None and "node" in message:   # back mid-round: the next round
                self.nodes[message["node"]] = conn
                continue
            if node is None or message is not None and message.get("end") != r:
                continue
            ended.add(node)
            if message is None:
                self._forget(conn)
                message = {"state": "lost", "status": 1, "report": (
                    f"jdp.launch: lost the launcher of node {node} (its connection closed); "
                    "stopped the processes of every node.")}
            if message["state"] == State.SIGNALED.value:
                signaled = signaled or message
            elif message["state"] in _ENDED and first is None:
                first = message
                self._broadcast({"stop": r})
        return first or signaled, signaled is not None

    def _forget(self, conn: socket.socket) -> None:
        self.nodes = {k: c for k, c in self.nodes.items() if c is not conn}

    def _broadcast(self, message: dict) -> None:
        for conn in list(self.nodes.values()):
            try:
                _net.send(conn, message)
            except OSError:
                pass


class Link:
    """One launcher's connection to the keeper: "stop" sets `stop` at once, the rest queue."""

    def __init__(self, conn: socket.socket, node: int):
        conn.settimeout(None)
        self.conn = conn
        self.messages: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.send({"node": node})
        threading.Thread(target=self._read, daemon=True).start()

    def send(self, message: dict) -> None:
        try:
            _net.send(self.conn, message)
        except OSError:   # the keeper is gone: `next` says so
            pass

    def _read(self) -> None:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_net.receive, args=(self.conn, lines), daemon=True).start()
        while True:
            _, message = lines.get()
            if message is None or "stop" in message:
                self.stop.set()
            if message is None or "stop" not in message:
                self.messages.put(message)
            if message is None:
                return

    def next(self) -> dict:
        """The keeper's next "start" or "exit" (an "exit" if the keeper vanished)."""
        message = self.messages.get()
        if message is None:
            return {"exit": 1, "report": "jdp.launch: lost node 0's launcher (its connection "
                                         "closed); stopped the processes of this node."}
        self.stop.clear()
        return message
