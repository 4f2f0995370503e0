"""Rounds: the one way the launcher runs a job, on one node or on many, fixed or elastic.

A job runs in rounds. Round r starts the ranks of every node present (JDP_RESTART_COUNT=r);
the first failure anywhere stops the round on every node at once (a half-restarted job would
end in JAX's "different incarnation" aborts); while restarts are left, the next round starts on
every node together (after a 1 s backoff with several nodes). Node 0's launcher keeps the
rounds (the *keeper*, a thread) and every launcher, node 0's included, is its client over one
connection of JSON lines: node 0's over a socket pair, the others' over TCP to
MASTER_ADDR:--rdzv_port.

    launcher -> keeper   {"node": k, "host": h, "nproc": p}           once, on connecting
    keeper -> launcher   {"start": r, "report": text | null, "round": text | null,
                          "node_rank": d, "nnodes": n, "first_rank": f, "world": w}
    launcher -> keeper   {"end": r, "state": S, "status": n, "report": text | null,
                          "goodput": summary | null}
    keeper -> launchers  {"stop": r}                                  another node failed
    keeper -> launchers  {"drain": r}                                 a node waits to join
    keeper -> launchers  {"exit": status, "report": text | null}      the job is over

k is the launcher's --node_rank, its name for the whole job; d is its NODE_RANK in round r:
the nodes present are numbered densely in the order of k (node 0, which runs process 0's
coordinator, is always d=0), and their ranks follow one another from f. S is an
`_outcome.State` value; node k > 0 sends its goodput summary so far (`_goodput`), which node
0's launcher merges into the job's one summary. A round's report (the first failure's,
formatted where it happened) and its summary line reach every launcher with the next "start"
or the "exit", so every node prints the same lines once.

Membership. A launcher that vanishes counts as a failure of its node (it is *lost*). With a
fixed --nnodes N the next round waits (up to JOIN_TIMEOUT_S) for a launcher of every node.
With --nnodes MIN:MAX a round starts as soon as MAX nodes are present, or with the nodes
present once at least MIN are and --rdzv_timeout seconds have passed since the round opened.
A launcher that connects during a round is *waiting*: the keeper sends "drain", every launcher
passes SIGTERM to its ranks (the preemption path: `jdp.preempted()` turns True on every rank
at the same step, the loop saves and leaves), and the next round starts with the waiting node.
That planned restart does not use --max_restarts, which bounds the rounds that follow a failure.
"""
from __future__ import annotations

import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from jdp.job import net as _net
from jdp.job import run as _run
from jdp.job import waiting as _waiting
from jdp.job.outcome import Job, Outcome, State, exit_status, report, round_line

BACKOFF_S = 1.0
JOIN_TIMEOUT_S = 300.0
RDZV_TIMEOUT_S = 30.0                   # elastic: how long a round waits for MAX nodes
_ENDED = ("failed", "stalled", "lost")   # states that end the round on every node
_LOST_NODE_0 = ("jdp.launch: lost node 0's launcher (its connection closed); stopped the "
                "processes of this node. Node 0 keeps the job's rounds and runs process 0's "
                "coordinator, so the job cannot go on without it: start the launchers again "
                "(node 0 on a machine that is up, its address as every node's --master_addr); "
                "the script resumes from its latest checkpoint.")


class Round(NamedTuple):
    """This node's place in one round, and the keeper's requests to end it early."""
    node_rank: int                # NODE_RANK: this node's index among the round's nodes
    nnodes: int                   # nodes in the round
    first_rank: int               # RANK of this node's LOCAL_RANK 0
    world: int                    # WORLD_SIZE: processes in the round
    stop: threading.Event         # another node failed: stop the ranks now
    drain: threading.Event        # a node waits to join: SIGTERM the ranks, let them save


class Member(NamedTuple):
    """A connected launcher, as the keeper knows it."""
    conn: socket.socket
    host: str
    nproc: int


def run(job: Job, max_restarts: int, rdzv: tuple | None,
        run_round: Callable[[int, Round], Outcome], min_nodes: int | None = None,
        rdzv_timeout_s: float = RDZV_TIMEOUT_S, ledger=None) -> int:
    """This node's part of the job: run the rounds the keeper starts; the exit status.

    Args:
        job: the job (this launcher's --node_rank as `node`, the most nodes as `nnodes`, and
            `world` = nnodes * processes per node).
        max_restarts: rounds after a failed one that may start.
        rdzv: (host, port) of node 0's keeper when there are several nodes, else None.
        run_round: runs this node's ranks for round r, placed as the Round says, until they
            end or its stop event is set.
        min_nodes: elastic --nnodes MIN:MAX: the fewest nodes a round may start with (None:
            fixed, every node).
        rdzv_timeout_s: elastic: how long a round waits for MAX nodes once MIN are there.
        ledger: this node's `_goodput.Ledger`: node k > 0 sends its summary at each round's
            end; on node 0 it receives the other nodes' last ones (`ledger.nodes`).
    """
    nodes = (job.nnodes if min_nodes is None else min_nodes, job.nnodes)
    keeper = Keeper(nodes, max_restarts, rdzv, rdzv_timeout_s) if job.node == 0 else None
    try:
        conn = keeper.connect_local() if keeper else _connect(job, rdzv)
        if conn is None:
            _say(f"{job.who}: node {job.node} could not reach node 0's launcher at "
                 f"{_net.join_host_port(*rdzv)} within {JOIN_TIMEOUT_S:g} s; start node 0 with "
                 "the same --master_addr and --master_port (and --rdzv_port)")
            return 1
        hello = {"node": job.node, "host": socket.gethostname(),
                 "nproc": job.world // job.nnodes}
        return _follow(Link(conn, hello), job, run_round, ledger)
    finally:
        if keeper is not None:
            keeper.close()
            if ledger is not None:
                ledger.nodes = dict(keeper.goodput)


def _connect(job: Job, rdzv: tuple) -> socket.socket | None:
    """A node's connection to node 0's keeper (None after JOIN_TIMEOUT_S), saying it waits."""
    address = _net.join_host_port(*rdzv)
    with _waiting.announced(lambda waited: (
            f"{job.who}: node {job.node} waits for node 0's launcher at {address}: "
            f"{_waiting.seconds(waited)} of at most {JOIN_TIMEOUT_S:g} s")):
        return _net.connect(*rdzv, JOIN_TIMEOUT_S)


def _next(link: Link, job: Job) -> dict:
    """The keeper's next message; a node waiting for a round to start says so."""
    with _waiting.announced(lambda waited: (
            f"{job.who}: node {job.node} is connected to node 0's launcher and waits for the "
            f"next round to start ({_waiting.seconds(waited)}; node 0 waits for the other "
            f"nodes, at most {JOIN_TIMEOUT_S:g} s)")):
        return link.next()


def _follow(link: Link, job: Job, run_round: Callable, ledger=None) -> int:
    """Run each round the keeper starts; print its reports; return its exit status."""
    own_signal = None
    try:
        while True:
            message = _next(link, job) if job.node else link.next()
            for text in (message.get("report"), message.get("round")):
                if text:
                    _say(text)
            if "exit" in message:
                return 128 + own_signal if own_signal else message["exit"]
            r = message["start"]
            place = Round(message["node_rank"], message["nnodes"], message["first_rank"],
                          message["world"], link.stop, link.drain)
            outcome = run_round(r, place)
            if outcome.state is State.SIGNALED:
                own_signal = outcome.detail.signal
            seen_as = job._replace(world=place.world, nnodes=place.nnodes, node=place.node_rank)
            link.send({"end": r, "state": outcome.state.value, "status": exit_status(outcome),
                       "report": report(outcome, seen_as) or None,
                       "goodput": ledger.summary(arrivals=True) if ledger and job.node
                       else None})
    finally:
        link.conn.close()


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Keeper:
    """Node 0's round keeper: a thread that runs the rounds of the whole job."""

    def __init__(self, nodes: tuple, max_restarts: int, address: tuple | None,
                 rdzv_timeout_s: float = RDZV_TIMEOUT_S):
        (self.min_nodes, self.max_nodes), self.max_restarts = nodes, max_restarts
        self.rdzv_timeout_s = rdzv_timeout_s
        self.address = address
        self.events: queue.Queue = queue.Queue()   # (connection, message or None at its end)
        self.nodes: dict = {}                      # --node_rank -> Member, connected now
        self.goodput: dict = {}                    # --node_rank k > 0 -> its last summary
        self.server = None if address is None else _net.listen(*address, self.max_nodes + 4)
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
        first, previous, restarts, r = None, None, 0, 0
        try:
            while True:
                members = self._await_nodes()
                line = None if previous is None else round_line(
                    r, previous, members, restarts, self.max_restarts, planned=first is None)
                self._start(r, members, first and first["report"], line)
                first, signaled, drained = self._round(r, members)
                if signaled or first is None and not drained:
                    break
                if first is not None and (restarts == self.max_restarts
                                          or first["status"] == _run.FINAL_EXIT):
                    break   # out of restarts, or a failure a restart cannot mend
                if first is not None:
                    restarts += 1
                previous, r = members, r + 1
                time.sleep(BACKOFF_S if self.max_nodes > 1 else 0.0)   # every node's ranks gone
            self._send({m.conn for m in self.nodes.values()},
                       {"exit": first["status"] if first else 0,
                        "report": first and first["report"]})
        except TimeoutError as e:
            self._send({m.conn for m in self.nodes.values()},
                       {"exit": 1, "report": f"jdp.launch: {e}"})

    def _await_nodes(self) -> dict:
        """The next round's nodes (--node_rank -> Member, in order): all MAX of them, or (elastic)
        at least MIN once --rdzv_timeout has passed; TimeoutError with fewer than MIN for long.
        While it waits, node 0 says for which nodes."""
        with _waiting.announced(self._waiting_for):
            return self._nodes_of_next_round()

    def _waiting_for(self, waited: float) -> str | None:
        missing = sorted(set(range(self.max_nodes)) - set(list(self.nodes)))
        if not missing or self.address is None:
            return None
        elastic = "" if self.min_nodes == self.max_nodes else (
            f"; --nnodes {self.min_nodes}:{self.max_nodes}: a round starts with all of them, "
            f"or with >= {self.min_nodes} after --rdzv_timeout {self.rdzv_timeout_s:g} s")
        limit = max(JOIN_TIMEOUT_S, self.rdzv_timeout_s)
        return (f"jdp.launch: node 0 waits for node(s) {missing} to connect at "
                f"{_net.join_host_port(*self.address)} ({len(self.nodes)} of {self.max_nodes} "
                f"here; {_waiting.seconds(waited)} of at most {limit:g} s{elastic})")

    def _nodes_of_next_round(self) -> dict:
        opened = time.monotonic()
        settle = opened + self.rdzv_timeout_s
        deadline = opened + max(JOIN_TIMEOUT_S, self.rdzv_timeout_s)
        while True:
            n, now = len(self.nodes), time.monotonic()
            if 0 in self.nodes and (n >= self.max_nodes or n >= self.min_nodes and now >= settle):
                return dict(sorted(self.nodes.items()))
            if now >= deadline:
                raise TimeoutError(self._missing(deadline - opened))
            until = settle if n >= self.min_nodes else deadline
            try:
                self._note(*self.events.get(timeout=max(0.0, until - now)))
            except queue.Empty:
                continue

    def _missing(self, waited_s: float) -> str:
        missing = sorted(set(range(self.max_nodes)) - set(self.nodes))
        if self.min_nodes == self.max_nodes:
            return f"node(s) {missing} did not connect within {waited_s:g} s"
        return (f"only {len(self.nodes)} node(s) {sorted(self.nodes)} connected within "
                f"{waited_s:g} s; --nnodes {self.min_nodes}:{self.max_nodes} needs at least "
                f"{self.min_nodes}: start the launchers of more of the nodes {missing}")

    def _note(self, conn: socket.socket, message: dict | None) -> None:
        """A launcher connected (hello) or its connection closed."""
        if message is None:
            self.nodes = {k: m for k, m in self.nodes.items() if m.conn is not conn}
        elif "node" in message and message["node"] in self.nodes:
            k, host = message["node"], self.nodes[message["node"]].host
            self._send({conn}, {"exit": 1, "report": (
                f"jdp.launch: node {k} is already in the job (its launcher runs on {host}); "
                "give this launcher a --node_rank that no running launcher uses")})
        elif "node" in message:
            self.nodes[message["node"]] = Member(conn, message.get("host", "?"),
                                                 message.get("nproc", 1))

    def _start(self, r: int, members: dict, report_text: str | None, line: str | None) -> None:
        """Send each member its place in round r (dense node ranks, consecutive ranks)."""
        world, first_rank = sum(m.nproc for m in members.values()), 0
        for d, m in enumerate(members.values()):
            self._send({m.conn}, {"start": r, "report": report_text, "round": line,
                                  "node_rank": d, "nnodes": len(members),
                                  "first_rank": first_rank, "world": world})
            first_rank += m.nproc

    def _round(self, r: int, members: dict) -> tuple:
        """Every member's end of round r: (the first failure's message or None, signaled?,
        drained?: ended to take in a waiting node).

        The first failure stops the round on every node. A signal (preemption) does not: the
        ranks agree on a step, save and leave by themselves; it only ends the restarts.
        """
        ended, first, signaled, drain, stopped = set(), None, None, False, False
        conns = {m.conn for m in members.values()}
        while len(ended) < len(members):
            conn, message = self.events.get()
            k = next((k for k, m in members.items() if m.conn is conn), None)
            if message is None or "node" in message:   # a launcher came or went
                self._note(conn, message)
                if message is None and k is not None and k not in ended:
                    message = {"state": "lost", "status": 1, "report": (
                        f"jdp.launch: lost the launcher of node {k} on {members[k].host} (its "
                        "connection closed); stopped the processes of every node.")}
                else:
                    if not drain and first is None and set(self.nodes) - set(members):
                        drain = True
                        self._send(conns, {"drain": r})
                    continue
            elif k is None or message.get("end") != r:
                continue
            ended.add(k)
            if message.get("goodput"):
                self.goodput[k] = {**message["goodput"], "last_round": r}
            stopped = stopped or message["state"] == State.STOPPED.value
            if message["state"] == State.SIGNALED.value:
                signaled = signaled or message
            elif message["state"] in _ENDED and first is None:
                first = message
                self._send(conns, {"stop": r})
        return first or signaled, signaled is not None, drain and stopped

    @staticmethod
    def _send(conns, message: dict) -> None:
        for conn in conns:
            try:
                _net.send(conn, message)
            except OSError:
                pass


class Link:
    """One launcher's connection to the keeper: "stop" and "drain" set their events at once,
    the rest queue."""

    def __init__(self, conn: socket.socket, hello: dict):
        conn.settimeout(None)
        self.conn = conn
        self.messages: queue.Queue = queue.Queue()
        self.stop, self.drain = threading.Event(), threading.Event()
        self.send(hello)
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
            if message is not None and "start" in message:   # here, not in `next`: a "stop"
                self.stop.clear()                            # may follow on the heels of
                self.drain.clear()                           # its round's "start"
            if message is None or "stop" in message:
                self.stop.set()
            elif "drain" in message:
                self.drain.set()
            if message is None or not ("stop" in message or "drain" in message):
                self.messages.put(message)
            if message is None:
                return

    def next(self) -> dict:
        """The keeper's next "start" or "exit" (an "exit" if the keeper vanished)."""
        message = self.messages.get()
        if message is None:
            return {"exit": 1, "report": _LOST_NODE_0}
        return message
