"""The roll call's connections, kept open while the job runs: a lost process named, a finished
one known at once, and where a peer is, asked only when a collective call waits for it.

Outside jdp's launcher nobody watches the ranks, and a survivor learns of a dead peer only
from its collective (`Gloo all-reduce failed: Connection reset by peer`, or a SIGABRT with a
C++ stack when process 0 is gone), which names no rank. Process 0 keeps one connection to
every other process (`_rendezvous`); the others keep theirs to process 0. On them:

* `{"bye"}`: the process leaves cleanly (at exit, or in `jdp.shutdown()`). A connection that
  closes without it is a lost process: process 0 names it and tells the others, a process
  that loses process 0 names process 0. The survivor prints the name at once, adds it to the
  error its main thread raises, and ends with exit code 1 within `GRACE_S` seconds unless
  that error ended it first: a collective that hangs on a dead peer (NCCL) cannot keep it
  alive.
* `{"finished": step}`: the script returned (sent at exit, before JAX's shutdown barrier);
  a collective call waiting for that process names it at once (`jdp.distributed._agree`).
* `{"where"}` / `{"here": place}`: where a peer is (its phase, step and the collective call it
  waits in), answered by this module's thread while the main thread may be blocked.
* `{"verdict": text}`: the job ends with `text` (a collective call that a process skipped):
  the receiver prints it and exits 1 at once, so no process is left to be aborted;
  process 0 passes it on to every other process first.
* `{"failed": text}`: the process raised `text` and ends (its uncaught exception): when its
  connection then closes, the peer names that failure, not a lost process.

Cost: nothing while the job runs; a few small messages at exit, and per question.
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
from jdp.job import progress as _progress
from jdp.job import run as _run

GRACE_S = 3.0        # time the main thread gets to fail by itself after a loss is known
ANSWER_S = 2.0       # the most a question to the peers waits for their answers
PASS_ON_S = 0.5      # process 0 lingers this long after passing on a verdict
INTERRUPTED_S = 2.0  # the most process 0 ending with the others' error waits for them to leave
# TCP keepalive on the connections (idle s, interval s, probes): a node that vanishes without
# closing them (power loss, a partition) is noticed after about 5 + 2 * 3 = 11 s.
KEEPALIVE = (5, 2, 3)
_ECHO = re.compile(r"gloo|nccl|connection (closed|reset) by peer|coordination service", re.I)


class Peers:
    """This process's connections to its peers and what they said, and the collective call it
    waits in (`waiting`: (who, n) or None), for a peer that asks where it is (one per
    process: `jdp.job.rank.current().peers`, over that process's `progress`)."""

    def __init__(self, progress: _progress.Progress) -> None:
        self.progress = progress
        self.me = 0
        self.conns: dict[int, socket.socket] = {}
        self.lost_text: list[str] = []
        self.lost_event = threading.Event()
        self.finished: dict[int, int] = {}      # rank -> the steps it ran, when its script ended
        self.failed: dict[int, str] = {}        # rank -> the error it ended with
        self.answers: dict[int, dict] = {}
        self.answered = threading.Condition()
        self.waiting: tuple[str, int] | None = None
        self.watched: set[int] = set()          # peers whose connection is watched
        self.closed: set[int] = set()           # those whose connection has ended
        self.closing = threading.Condition()
        self._send_lock = threading.Lock()

    def watch(self, conns: dict, me: int) -> None:
        """Watch the roll call's connections `conns` ({rank: socket}) of process `me`."""
        self.me = me
        self.conns.update(conns)
        self.watched.update(conns)
        events: queue.Queue = queue.Queue()
        for rank, conn in conns.items():
            conn.settimeout(None)
            _keepalive(conn)
            threading.Thread(target=self._receive, args=(conn, events, rank), daemon=True,
                             name=f"jdp-peer-{rank}").start()
        threading.Thread(target=self._judge, args=(events,), daemon=True,
                         name="jdp-peers").start()
        atexit.register(self.goodbye)

    def send(self, rank: int, message: dict) -> bool:
        """Send `message` to peer `rank`; False when there is no open connection to it."""
        conn = self.conns.get(rank)
        if conn is None:
            return False
        try:
            with self._send_lock:
                _net.send(conn, message)
            return True
        except OSError:
            return False

    def place(self) -> dict:
        """Where this process is: its progress (count, steps run, phase) and the call it
        waits in."""
        count, step, phase = self.progress.current() or (0, -1, "start")
        return {"count": count, "step": step, "phase": phase, "in": self.waiting}

    def goodbye(self) -> None:
        """Tell the peers this process leaves cleanly (not lost); safe to call twice."""
        step = self.place().get("step", -1)
        while self.conns:
            rank = next(iter(self.conns))
            self.send(rank, {"bye": True, "step": step})
            self.conns.pop(rank, None)

    def script_finished(self) -> None:
        """At exit: tell the peers this process's script returned (it waits for them now)."""
        for rank in list(self.conns):
            self.send(rank, {"finished": self.place().get("step", -1)})

    def failing(self, error: BaseException) -> None:
        """This process ends with `error` (uncaught): tell the peers, so they name it.

        Process 0 ended by Ctrl-C, or by an error every process raised (`run.SHARED`: an
        agreement's verdict), waits up to `INTERRUPTED_S` for the others, which got the same
        SIGINT or error, to leave first: the coordination service ends with process 0, and a
        peer still on its way to its own error would die of that instead (a SIGABRT with a
        C++ stack in place of its traceback).
        """
        first = (str(error).strip().splitlines() or [""])[0][:300]
        for rank in list(self.conns):
            self.send(rank, {"failed": f"{type(error).__name__}: {first}"})
        if self.me == 0 and (isinstance(error, KeyboardInterrupt)
                             or getattr(error, _run.SHARED, False)):
            self.wait_gone(INTERRUPTED_S)

    def wait_gone(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until every watched peer's connection has ended (the peers
        have left); True if they all have. Process 0 waits so before it leaves a job that is
        ending anyway: the coordination service ends with it, and a peer still leaving would
        die of that instead (a SIGABRT with a C++ stack)."""
        deadline = time.monotonic() + timeout_s
        with self.closing:
            while (left := deadline - time.monotonic()) > 0 and not self.closed >= self.watched:
                self.closing.wait(left)
            return self.closed >= self.watched

    def _receive(self, conn: socket.socket, events: queue.Queue, rank: int) -> None:
        """Read peer `rank`'s messages into `events` (`_net.receive`); note when it ends."""
        _net.receive(conn, events, rank)
        with self.closing:
            self.closed.add(rank)
            self.closing.notify_all()

    def lost(self, error: BaseException | None = None) -> str | None:
        """The message naming the lost process, or None while none is lost. Given the
        `error` the main thread fails with, waits up to a second when it looks like a lost
        peer's echo (its connection and the failed collective break at the same moment)."""
        if error is not None and self.conns and _ECHO.search(str(error)):
            self.lost_event.wait(1.0)
        return self.lost_text[0] if self.lost_text else None

    def locate(self, ranks: list[int], timeout_s: float = ANSWER_S) -> dict[int, dict]:
        """Ask `ranks` (peers with a connection to this process) where they are; {rank:
        place} for those that answered within `timeout_s`."""
        with self.answered:
            for rank in ranks:
                self.answers.pop(rank, None)
        asked = [rank for rank in ranks if self.send(rank, {"where": True})]
        deadline = time.monotonic() + timeout_s
        with self.answered:
            while (left := deadline - time.monotonic()) > 0 and not all(
                    r in self.answers for r in asked):
                self.answered.wait(left)
            return {r: self.answers[r] for r in asked if r in self.answers}

    def end_job(self, ranks: list[int], text: str) -> None:
        """Tell `ranks` that the job ends with `text`; each prints it and exits 1."""
        for rank in ranks:
            self.send(rank, {"verdict": text})

    def _judge(self, events: queue.Queue) -> None:
        """Read the peers' messages until one is lost (or every peer said goodbye)."""
        left = set(self.conns)
        while left:
            rank, message = events.get()
            if message is None and rank in left and rank in self.conns:
                return self._lose(rank, self.failed.get(rank))
            if message is None or "bye" in message:
                left.discard(rank)
                self.finished.setdefault(rank, (message or {}).get("step", -1))
            else:
                self._answer(rank, message)
            if message is not None and "lost" in message:
                return self._lose(message["lost"], message.get("failed"), "reported by process 0")

    def _answer(self, rank: int, message: dict) -> None:
        """A peer's question, answer or news (see the module docstring)."""
        if "finished" in message:
            self.finished[rank] = message["finished"]
        elif "failed" in message:
            self.failed[rank] = message["failed"]
        elif "where" in message:
            self.send(rank, {"here": self.place()})
        elif "here" in message:
            with self.answered:
                self.answers[rank] = message["here"]
                self.answered.notify_all()
        elif "verdict" in message:
            print(message["verdict"], file=sys.stderr, flush=True)
            self._pass_on(rank, message)
            _run.leave_with(1)
            self.goodbye()
            _run.exit_now(1)

    def _pass_on(self, sender: int, message: dict) -> None:
        """Process 0, told by process `sender` that the job ends, tells every other process
        (only process 0 is connected to all) and gives them `PASS_ON_S` to print it: with 3
        or more processes, the others would otherwise lose the coordination service, which
        ends with process 0, before they read the verdict, and fail with raw errors."""
        if self.me != 0:
            return
        others = [r for r in self.conns if r != sender]
        for other in others:
            self.send(other, message)
        if others:
            time.sleep(PASS_ON_S)

    def _lose(self, rank: int, failed: str | None,
              how: str = "its connection closed without leaving the job") -> None:
        """Name the lost process, pass it on (process 0), and end this process after GRACE_S;
        a failed one (its error said) is named only if this process is still there then."""
        me = self.me
        for other in list(self.conns) if me == 0 else ():
            self.send(other, {"lost": rank, "failed": failed})
        if failed:   # its own error says why: this process speaks only if it would hang
            time.sleep(GRACE_S)
            print(f"jdp: process {me} stops: process {rank} failed ({failed})", file=sys.stderr,
                  flush=True)
            _run.exit_now(1)
        text = (f"jdp: process {me} lost process {rank} of the job ({how}: it was killed, "
                f"crashed or lost its node); process {me} stops too")
        self.lost_text.append(text)
        self.lost_event.set()
        print(text, file=sys.stderr, flush=True)
        time.sleep(GRACE_S)
        _run.exit_now(1)


def _keepalive(conn: socket.socket) -> None:
    """Probe an idle connection so a silent peer counts as lost (Linux options where known)."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE,
                           strict=True):
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
