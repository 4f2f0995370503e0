"""Building batches off the training thread: the prefetch thread and the worker processes.

Prefetch: a daemon thread computes `fn(i)` a bounded queue ahead, so that reading,
transforming and the host-to-device copy overlap the training step. It holds no reference to
the Loader or the iterator: closing or collecting the iterator stops it within one queue poll.
Every queue wait has a timeout, so neither side can hang on the other.

Workers (`Loader(..., num_workers=k)`): worker i builds the host batches b with b % k == i, in
the order asked, and answers on its own pipe, so the batches come out in order with no
reordering buffer: those of `num_workers=0`. Workers are forked by a 'forkserver', never from
the training process (JAX is not fork-safe), get the `Recipe` once and an `EpochPlan` per pass.
`close()` (the Loader's, its garbage collection, interpreter exit) asks them to stop, then
terminates and kills; a worker whose parent died sees its pipe close and exits. Results travel
through pipes, so no shared memory can leak. A worker that raises sends the exception back;
one that dies is reported with the batch and example indices it was building.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from jdp.data import _sources

_POLL_S = 0.05
_JOIN_S = 1.0  # a prefetch thread still busy after this exits when its current batch is built
_STOP_S = 2.0  # a worker that does not stop after this is terminated, then killed
_DRAIN_S = 2.0  # what an abandoned pass still owes after this is dropped with its workers
_END = object()


class _Failure(NamedTuple):
    """An exception raised by `fn` in the thread, carried to the consumer."""
    error: BaseException


def prefetched(fn: Callable[[int], Any], items: range, depth: int,
               timeout: float | None) -> Iterator:
    """`fn(i) for i in items`, computed up to `depth` ahead in a thread (inline when depth is 0).

    It has `close()`; `fn`'s errors, and `timeout` seconds without a result, raise in the consumer.
    With depth 0 and a timeout, each `fn(i)` runs in the thread only when asked for (nothing
    ahead), so that the timeout holds there too.
    """
    if depth == 0 and timeout is None:
        return (fn(i) for i in items)
    return _Prefetcher(fn, items, depth, timeout)


class _Prefetcher:
    """Iterator over `fn(i)` for i in `items`, produced by a daemon thread (on demand: depth 0)."""

    def __init__(self, fn: Callable[[int], Any], items: range, depth: int,
                 timeout: float | None):
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._timeout = timeout
        self._asked = threading.Semaphore(0) if depth == 0 else None
        self._thread = threading.Thread(target=_produce, name="jdp-loader-prefetch", daemon=True,
                                        args=(fn, items, self._queue, self._stop, self._asked))
        self._finalizer = weakref.finalize(self, _shutdown, self._stop, self._thread)
        self._thread.start()

    def __iter__(self) -> _Prefetcher:
        return self

    def __next__(self) -> Any:
        if not self._finalizer.alive:
            raise StopIteration
        if self._asked is not None:
            self._asked.release()
        item = self._get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Stop the thread and wait for it (idempotent)."""
        self._finalizer()

    def _get(self) -> Any:
        start = time.monotonic()
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                pass
            if not self._thread.is_alive() and self._queue.empty():
                self.close()
                raise RuntimeError("Loader: the prefetch thread ended without a batch or an "
                                   "error (interpreter shutting down?)")
            if self._timeout is not None and time.monotonic() - start > self._timeout:
                self.close()
                raise TimeoutError(f"Loader: no batch arrived within timeout={self._timeout:g} s; "
                                   "is reading the source stuck? Pass a larger timeout= to the "
                                   "Loader if reading one batch legitimately takes longer")


def _produce(fn: Callable[[int], Any], items: range, out: queue.Queue,
             stop: threading.Event, asked: threading.Semaphore | None) -> None:
    try:
        for i in items:
            while asked is not None and not asked.acquire(timeout=_POLL_S):
                if stop.is_set():
                    return
            if stop.is_set() or not _put(out, fn(i), stop):
                return
    except Exception as err:  # noqa: BLE001 -- every error goes to the consumer
        _put(out, _Failure(err), stop)
        return
    _put(out, _END, stop)


def _put(out: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put `item`, polling so that a stop request is noticed; False when stopped."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _shutdown(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    if thread is not threading.current_thread():
        thread.join(timeout=_JOIN_S)


class WorkerTraceback(Exception):
    """The traceback of an error raised in a worker process (chained as its cause)."""

    def __str__(self) -> str:
        return "\n\n(in the worker process)\n" + self.args[0]


class Cancelled(Exception):
    """A newer pass started (or the pool closed) while this one waited for a batch."""


class Busy(Exception):
    """The workers still build batches an abandoned pass asked for: start fresh ones."""


class _Discard:
    """A file that forgets what is written: checks picklability without holding a copy."""

    def write(self, data) -> int:  # bytes, or a PickleBuffer for a large array
        return memoryview(data).nbytes


def check_picklable(recipe: _sources.Recipe, num_workers: int) -> None:
    """A clear TypeError now, at construction, when the workers could not receive `recipe`."""
    try:
        pickle.dump(recipe, _Discard(), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as err:  # noqa: BLE001 -- pickle raises several types
        try:  # which of the two is it?
            pickle.dump(recipe.read, _Discard(), protocol=pickle.HIGHEST_PROTOCOL)
            what = "transform"
        except Exception:  # noqa: BLE001
            what = "source"
        raise TypeError(f"Loader: num_workers={num_workers} needs a picklable source and "
                        f"transform (worker processes receive them by pickle), but the {what} "
                        f"is not ({type(err).__name__}: {err}); define it at module level (no "
                        "lambda or local function), or use num_workers=0") from err


class Pool:
    """k worker processes building host batches; one pass (epoch iteration) at a time."""

    def __init__(self, recipe: _sources.Recipe, num_workers: int):
        recipe = pickle.dumps(recipe, protocol=pickle.HIGHEST_PROTOCOL)  # once for all workers
        # Workers fork from a 'forkserver' that has imported jdp but started no JAX backend, in
        # milliseconds: only the first pool pays the imports. They inherit its environment,
        # taken when the first pool starts.
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        self._conns, self._procs = [], []
        for i in range(num_workers):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_work, args=(theirs, recipe, os.getpid()), daemon=True,
                               name=f"jdp-loader-worker-{i}")
            proc.start()
            theirs.close()
            self._conns.append(mine)
            self._procs.append(proc)
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._owed = [0] * num_workers  # batches asked of worker i and not yet received
        self.broken = False  # a worker died: the Loader starts a fresh pool

    def start_pass(self, plan: _sources.EpochPlan, items: range, ahead: int):
        """A function `get(b)` returning host batch b, called for b in `items` in order.

        What an abandoned pass still owes is received and dropped first (no stale results);
        if it has not all come within `_DRAIN_S` (a slow or stuck source), the pool is broken
        and `Busy` says to start fresh workers rather than wait on batches nobody wants.
        """
        self._cancel.set()  # a getter of the previous pass still waiting gives up
        with self._lock:
            self._cancel = cancel = threading.Event()
            drained_by = time.monotonic() + _DRAIN_S
            for i in range(len(self._procs)):
                while self._owed[i]:
                    self._next_result(i, None, None, cancel, drained_by)
            for i in range(len(self._procs)):
                self._ask(i, ("plan", plan))
            to_send, k = iter(items), len(self._procs)

        def get(b: int) -> dict:
            with self._lock:
                if cancel.is_set():  # a late call of an abandoned pass must not ask anything
                    raise Cancelled
                for nxt in to_send:  # keep `ahead` batches requested beyond b
                    self._ask(nxt % k, ("batch", nxt))
                    self._owed[nxt % k] += 1
                    if nxt >= b + ahead:
                        break
                kind, got, payload = self._next_result(b % k, b, plan, cancel)
            if kind == "error":
                raise payload[0] from WorkerTraceback(payload[1])
            assert got == b, (got, b)  # each worker answers in the order asked
            return payload

        return get

    def _ask(self, i: int, message: tuple) -> None:
        """Send worker i a message; a closed pipe means the worker died."""
        try:
            _send(self._conns[i], message)
        except (OSError, ValueError):
            self.broken = True
            raise _died(i, self._procs[i], None, None) from None

    def _next_result(self, i: int, b: int | None, plan: _sources.EpochPlan | None,
                     cancel: threading.Event, by: float | None = None) -> tuple:
        """The next reply of worker i (waiting for batch b of `plan`, for the error message);
        `Busy` if none has come at monotonic time `by`."""
        conn, proc = self._conns[i], self._procs[i]
        while not conn.poll(_POLL_S):
            if cancel.is_set():
                raise Cancelled
            if by is not None and time.monotonic() > by:
                self.broken = True
                raise Busy
            if not proc.is_alive():
                self.broken = True
                raise _died(i, proc, b, plan)
        try:
            reply = _recv(conn)
        except (EOFError, OSError):
            self.broken = True
            raise _died(i, proc, b, plan) from None
        self._owed[i] -= 1
        return reply

    def close(self) -> None:
        """Stop every worker: ask, then terminate, then kill (idempotent)."""
        self._cancel.set()
        for conn in self._conns:
            try:
                _send(conn, ("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + _STOP_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            for end in (proc.terminate, proc.kill):
                if proc.is_alive():
                    end()
                    proc.join(_STOP_S)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]


def _send(conn, message: tuple) -> None:
    """Pickle `message` with its arrays' memory sent as raw frames after it (no extra copy)."""
    buffers: list = []
    head = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    conn.send_bytes(len(buffers).to_bytes(4, "little") + head)
    for buffer in buffers:
        conn.send_bytes(buffer.raw())


def _recv(conn) -> Any:
    """The message `_send` sent; arrays are views of the received frames (read-only)."""
    first = conn.recv_bytes()
    frames = [conn.recv_bytes() for _ in range(int.from_bytes(first[:4], "little"))]
    return pickle.loads(memoryview(first)[4:], buffers=frames)


def _died(i: int, proc, b: int | None, plan: _sources.EpochPlan | None) -> RuntimeError:
    proc.join(_POLL_S)
    what = "between batches"
    if plan is not None:
        idx = _sources.rows(plan, b)[0].tolist()
        what = f"while building batch {b} (example indices {_sources.shown(idx)})"
    return RuntimeError(f"Loader: worker {i} (pid {proc.pid}) died with exit code "
                        f"{proc.exitcode} {what}; see its output above (a script starting "
                        "workers needs `if __name__ == '__main__':`), or run with num_workers=0 "
                        "to see a crash of the source or transform in this process")


def _work(conn, recipe_bytes: bytes, parent: int) -> None:
    """Worker main loop: build the batches asked for until told to stop or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    import jax

    jax.config.update("jax_platforms", "cpu")  # a transform using jax must not take the GPU
    recipe = pickle.loads(recipe_bytes)
    plan = None
    while True:
        try:
            if not conn.poll(1.0):
                if not _alive(parent):  # its pipe's EOF says so too; this is the backstop
                    return
                continue
            message = _recv(conn)
        except (EOFError, OSError):
            return
        if message[0] == "stop":
            return
        if message[0] == "plan":
            plan = message[1]
            continue
        b = message[1]
        try:
            reply = ("ok", b, _sources.host_batch(recipe, plan, b))
        except Exception as err:  # noqa: BLE001 -- every error goes to the consumer
            reply = ("error", b, (_portable(err), "".join(traceback.format_exception(err))))
        try:
            _send(conn, reply)
        except (OSError, ValueError):
            return


def _alive(pid: int) -> bool:
    """Whether process `pid` (the Loader's process, not the forkserver parent) still runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _portable(err: Exception) -> Exception:
    """`err` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(err).__name__}: {err}")

