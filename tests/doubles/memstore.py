"""An in-memory double of JAX's coordination-service key-value store that counts the work.

jdp's agreement points, in-job watchdog and roll call talk to process 0's coordination
service; what they cost there at thousands of hosts cannot be run on one machine, but their
logic can: `Store` holds the keys like the service does (set, blocking get, try get,
directory get, delete of a key and its directory, increment), and `Store.client(rank)` gives
each simulated process (a thread) a client whose every call counts one request and the bytes
it sends and receives. The tests prove constant requests per process and bounded keys with
it; `make bench` turns the counts into the scaling table of BENCHMARKS.md.
"""
from __future__ import annotations

import collections
import threading
import time

import jax


class Counts:
    """Requests and bytes of one simulated process."""

    def __init__(self):
        self.requests = 0
        self.sent = 0         # bytes of keys and values sent
        self.received = 0     # bytes of keys and values received
        self.by_method: collections.Counter = collections.Counter()


class Store:
    """The service: keys in memory, one lock, one event per awaited key."""

    def __init__(self):
        self._data: dict[str, str] = {}
        self._lock = threading.Lock()
        self._waiting: dict[str, threading.Event] = {}
        self.counts: dict[int, Counts] = collections.defaultdict(Counts)
        self.closed = False

    def close(self) -> None:
        """The service goes away: every later call raises, as when a job ends."""
        self.closed = True

    def client(self, rank: int) -> Client:
        return Client(self, rank)

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._data)

    def bytes_held(self) -> int:
        with self._lock:
            return sum(len(k) + len(v) for k, v in self._data.items())

    def reset_counts(self) -> None:
        self.counts.clear()

    def _set(self, key: str, value: str, overwrite: bool) -> None:
        with self._lock:
            if key in self._data and not overwrite:
                raise jax.errors.JaxRuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
            self._data[key] = value
            if (event := self._waiting.pop(key, None)) is not None:
                event.set()

    def _get(self, key: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if key in self._data:
                    return self._data[key]
                event = self._waiting.setdefault(key, threading.Event())
            left = deadline - time.monotonic()
            if left <= 0 or not event.wait(left):
                raise jax.errors.JaxRuntimeError(
                    f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")

    def _try_get(self, key: str) -> str:
        with self._lock:
            if key not in self._data:
                raise jax.errors.JaxRuntimeError(f"NOT_FOUND: Config key {key} not found.")
            return self._data[key]

    def _dir(self, key: str) -> list[tuple[str, str]]:
        prefix = key.rstrip("/") + "/"
        with self._lock:
            return sorted((k, v) for k, v in self._data.items() if k.startswith(prefix))

    def _delete(self, key: str) -> None:
        prefix = key.rstrip("/") + "/"
        with self._lock:
            for k in [k for k in self._data if k == key.rstrip("/") or k.startswith(prefix)]:
                del self._data[k]

    def _increment(self, key: str, by: int) -> int:
        with self._lock:
            value = int(self._data.get(key, "0")) + by
            self._data[key] = str(value)
            return value


class Client:
    """One simulated process's client: the methods jdp calls on JAX's, each one counted."""

    def __init__(self, store: Store, rank: int):
        self.store, self.rank = store, rank

    def _count(self, method: str, sent: int, received: int = 0) -> None:
        if self.store.closed:
            raise jax.errors.JaxRuntimeError("UNAVAILABLE: the coordination service is gone")
        c = self.store.counts[self.rank]
        c.requests += 1
        c.sent += sent
        c.received += received
        c.by_method[method] += 1

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self._count("set", len(key) + len(value))
        self.store._set(key, value, allow_overwrite)

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        try:
            value = self.store._get(key, timeout_in_ms / 1000)
        finally:
            self._count("get", len(key))
        self.store.counts[self.rank].received += len(value)
        return value

    def key_value_try_get(self, key: str) -> str:
        try:
            value = self.store._try_get(key)
        finally:
            self._count("try_get", len(key))
        self.store.counts[self.rank].received += len(value)
        return value

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        found = self.store._dir(key)
        self._count("dir_get", len(key), sum(len(k) + len(v) for k, v in found))
        return found

    def key_value_delete(self, key: str) -> None:
        self._count("delete", len(key))
        self.store._delete(key)

    def key_value_increment(self, key: str, increment: int) -> int:
        self._count("increment", len(key) + 8, 8)
        return self.store._increment(key, increment)
