"""Background prefetch: compute `fn(i)` for a range of i in a thread, a bounded queue ahead.

The Loader prepares host batches and puts them on the devices here, so that reading, gathering
and the host-to-device copy overlap the training step. The thread holds no reference to the
Loader or to the consuming iterator: when the iterator is closed or garbage-collected the thread
is told to stop, and it stops within one queue poll. Every queue wait has a timeout, so neither
side can hang on the other.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

_POLL_S = 0.05
_JOIN_S = 1.0  # a thread still busy after this exits when its current batch is built
_END = object()


class _Failure:
    """An exception raised by `fn` in the thread, carried to the consumer."""

    def __init__(self, error: BaseException):
        self.error = error


def prefetched(fn: Callable[[int], Any], items: range, depth: int,
               timeout: float | None) -> Iterator:
    """`fn(i) for i in items`, computed up to `depth` ahead in a thread (inline when depth is 0).

    The result has `close()`; exceptions from `fn` are raised in the consumer; a `timeout`
    (seconds without a result) raises TimeoutError instead of waiting forever.
    """
    if depth == 0:
        return (fn(i) for i in items)
    return _Prefetcher(fn, items, depth, timeout)


class _Prefetcher:
    """Iterator over `fn(i)` for i in `items`, produced by a daemon thread."""

    def __init__(self, fn: Callable[[int], Any], items: range, depth: int,
                 timeout: float | None):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._timeout = timeout
        self._thread = threading.Thread(target=_produce, name="jdp-loader-prefetch", daemon=True,
                                        args=(fn, items, self._queue, self._stop))
        # Stops the thread on close() or when this iterator is garbage-collected.
        self._finalizer = weakref.finalize(self, _shutdown, self._stop, self._thread)
        self._thread.start()

    def __iter__(self) -> _Prefetcher:
        return self

    def __next__(self) -> Any:
        if not self._finalizer.alive:
            raise StopIteration
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
                raise TimeoutError(f"Loader: no batch arrived within timeout={self._timeout} s; "
                                   "is reading the source stuck? Pass a larger timeout= to the "
                                   "Loader if reading one batch legitimately takes longer")


def _produce(fn: Callable[[int], Any], items: range, out: queue.Queue,
             stop: threading.Event) -> None:
    try:
        for i in items:
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
