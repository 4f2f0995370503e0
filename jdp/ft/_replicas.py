"""`Replicas`: this replica group's side of a fault-tolerant job.

Each attempt at a step asks torchft for the quorum (the groups alive now), computes this
group's gradient (`jdp.train_step`'s first half on the group's own devices), sums the
gradients of the groups in the quorum on the host over torchft's process group, and commits
the update only if every group's all-reduce succeeded (torchft's `should_commit`). An attempt
that fails (a group died during it) is discarded by every survivor and redone with the same
batch in the next quorum. A group that comes back heals from a live peer before it computes.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jdp.core import split_train_step
from jdp.data import DistributedSampler
from jdp.distributed import print0, require_job
from jdp.ft import _coords, _exchange, _manager
from jdp.job import env as _env
from jdp.job import events as _events

START_TIMEOUT_S = 300.0   # a fresh job's first step waits this long for every group
NOTICE_S = 10.0           # and says so after this long
_SUM, _MEAN = "sum", "mean"


class Replicas:
    """This replica group among the job's groups: the quorum, the exchange, the heal.

    Args:
        state: the group's train state, as `jdp.broadcast` placed it (any layout); a group
            that heals replaces it with a live peer's.
        loader: a `jdp.data.Loader` over `jdp.ft.sampler(...)`: the group's share of every
            step; its position travels with a heal.
        group, groups, lighthouse: default: `JDP_REPLICA_GROUP`, `JDP_REPLICA_GROUPS`,
            `JDP_FT_LIGHTHOUSE` (set by `jdp.launch --replica_group G --replica_groups R
            --ft_lighthouse ...`).
        start_timeout: seconds a fresh job's first step waits for all `groups` to join
            before it starts with those present.
        quorum_timeout: seconds one quorum may take before the process raises.
        timeout: seconds an all-reduce, a commit vote, a state transfer or the set-up of a
            quorum's process group may take before the attempt is discarded. A group that
            dies after a quorum counted it and before the process group was set up holds the
            survivors this long (not the 1 s of a death anywhere else).

    Example (in a script started by `jdp.launch --replica_group G ...`)::

        replicas = jdp.ft.Replicas(state, loader)
        step = replicas.train_step(loss_fn)
        for batch in replicas.batches(num_steps):
            state, metrics = step(state, batch)
    """

    def __init__(self, state: Any, loader: Any = None, *, group: int | None = None,
                 groups: int | None = None, lighthouse: str | None = None,
                 start_timeout: float = START_TIMEOUT_S, quorum_timeout: float = 60.0,
                 timeout: float = _manager.OP_TIMEOUT_S):
        require_job("jdp.ft.Replicas")
        for name, value in (("start_timeout", start_timeout), ("quorum_timeout", quorum_timeout),
                            ("timeout", timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"jdp.ft.Replicas: {name}={value!r} is not a positive number "
                                 "of seconds; pass one")
        self.coords = _coords.coordinates(group, groups, lighthouse)
        self._state, self.loader = state, loader
        self._position = loader.state_dict() if loader is not None else None
        self.start_timeout = float(start_timeout)
        self._quorum_timeout = float(quorum_timeout)
        self._healed: Any = None      # a peer's state, placed, for the next step call
        self._batch: Any = None       # the batch of the step under way, kept for a retry
        self._epochs: Iterator | None = None
        self._ready = False           # a quorum was held for the attempt the step makes
        self._began = 0.0             # when the attempt began (its quorum)
        self.history: list = []       # (step, groups) of every step this group committed
        self.groups: list = []        # the groups of the last attempt's all-reduce
        self.committed: bool | None = None
        primary = jax.process_index() == 0
        self._events = self.coords.events if primary else None   # the group's record
        self._manager, self._pg, self._store = _manager.manager(
            self.coords, self._state_dict, self._load_state_dict, quorum_timeout, timeout)
        self._record("join", group=self.coords.group, pid=os.getpid(),
                     restart=int(os.environ.get(_env.RESTART_COUNT, 0)))

    @property
    def step(self) -> int:
        """Steps committed so far (the same on every group in the quorum)."""
        return self._manager.current_step()

    @property
    def state(self) -> Any:
        """The latest state: after a heal, the peer's."""
        return self._state

    def train_step(self, loss_fn: Callable, **options: Any) -> Callable:
        """`jdp.train_step(loss_fn, **options)` whose gradient is summed over the groups in
        the quorum: `step(state, batch) -> (state, metrics)`. A discarded attempt returns the
        state it was given (`replicas.committed` is False); after a heal the step starts
        from the peer's state, whatever state it is given."""
        gradients, update = split_train_step(loss_fn, **options)
        mean = options.get("grad_reduce", "mean") == "mean"

        def step(state, batch):
            return self._attempt(gradients, update, mean, state, batch)
        return step

    def batches(self, num_steps: int) -> Iterator:
        """The group's batch of each step until `num_steps` are committed: a quorum before
        each (a heal when this group comes back), and the same batch again after a
        discarded attempt."""
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"Replicas.batches: num_steps={num_steps!r} is not a positive int; "
                             "pass the number of steps to commit")
        if self.loader is None:
            raise ValueError("Replicas.batches: no loader; pass Replicas(state, loader) with a "
                             "jdp.data.Loader over jdp.ft.sampler(len(source))")
        while self.step < num_steps:
            self._quorum()
            if self._batch is None:
                self._batch = self._next_batch()
            self._ready = True
            yield self._batch
            if self._ready:
                raise RuntimeError("Replicas.batches: a batch went by without a step; call "
                                   "the step from replicas.train_step once per batch")

    def _next_batch(self) -> Any:
        if self._epochs is None:
            self._epochs = _forever(self.loader)
        return next(self._epochs)

    def _quorum(self) -> None:
        """torchft's quorum for the next attempt; a fresh job's first step waits until every
        group has joined (or `start_timeout`)."""
        began, noticed = time.monotonic(), False
        while True:
            self._began = time.perf_counter()
            try:
                self._manager.start_quorum()
            except TimeoutError as e:
                raise TimeoutError(
                    f"jdp.ft: no quorum within quorum_timeout={self._quorum_timeout:g} s from "
                    f"the Lighthouse at {self.coords.lighthouse}: is it running and reachable? "
                    "(its launcher then restarts this group's processes, --max_restarts)") from e
            m = self._manager
            if m.current_step() > 0 or m.num_participants() >= self.coords.groups:
                return
            waited = time.monotonic() - began
            if not noticed and waited > NOTICE_S:
                noticed = True
                print0(f"jdp.ft: group {self.coords.group} waits for the other replica groups "
                       f"to join the first step: {m.num_participants()} of "
                       f"{self.coords.groups} so far (up to start_timeout="
                       f"{self.start_timeout:g} s)", file=sys.stderr)
            if waited > self.start_timeout:
                warnings.warn(f"jdp.ft: {m.num_participants()} of {self.coords.groups} replica "
                              f"groups joined within {self.start_timeout:.0f} s; starting "
                              "with those", stacklevel=3)
                return
            time.sleep(0.1)

    def _attempt(self, gradients, update, mean, state, batch):
        if not self._ready:
            raise RuntimeError("Replicas: the step ran outside `for batch in "
                               "replicas.batches(num_steps)`, which holds each step's quorum")
        self._ready = False
        if self._healed is not None:
            state, self._healed = self._healed, None
        grads, new_ms, metrics = gradients(state, batch)
        kinds = ((grads, _MEAN if mean else _SUM), (new_ms, _MEAN), (metrics, _MEAN))
        host = [(_exchange.to_host(tree), kind) for tree, kind in kinds]
        reduced, self.groups = self._allreduce(host)
        self.committed = self._manager.should_commit()
        seconds = time.perf_counter() - self._began
        if not self.committed:
            self._record("discard", step=self.step + 1, groups=self.groups, seconds=seconds,
                         error=_error_line(self._manager.errored()))
            return state, metrics
        grads, new_ms, metrics = (_exchange.from_host(tree, values)
                                  for (tree, _), values in zip(kinds, reduced, strict=True))
        self._state = update(state, grads, new_ms)
        self._batch = None
        if self.loader is not None:   # the batches of the committed steps, all handed out
            self._position = self.loader.state_dict()
        self.history.append((self.step, self.groups))
        self._record("commit", step=self.step, groups=self.groups, seconds=seconds)
        return self._state, metrics

    def _allreduce(self, host: list) -> tuple[list, list]:
        """The trees' float pieces summed over the quorum's groups (the means divided by the
        number of groups), and which groups took part: a one-hot row of this group's index
        rides in the same all-reduce, so the sum names them."""
        import torch
        from torch.distributed import ReduceOp
        floats = [_floats(values) for values, _ in host]
        buffers = [_exchange.pack(pieces) for pieces in floats]
        member = np.zeros(self.coords.groups, np.float32)
        member[self.coords.group] = 1
        tensors = [torch.from_numpy(b) for bufs in buffers for b in bufs.values()]
        tensors.append(torch.from_numpy(member))
        works = [self._manager.allreduce(t, reduce_op=ReduceOp.SUM) for t in tensors]
        for work in works:
            work.wait()
        if self._manager.errored():
            # a group died during it: closing this process's links now fails the all-reduce
            # of every survivor still waiting in it, instead of at the next quorum
            self._pg.abort()
        groups = [int(i) for i in np.flatnonzero(member > 0.5)]
        out = []
        for (values, kind), pieces, bufs in zip(host, floats, buffers, strict=True):
            if kind == _MEAN:
                for b in bufs.values():
                    b /= max(len(groups), 1)
            out.append(_merge(values, _exchange.unpack(bufs, pieces)))
        return out, groups

    def _state_dict(self) -> dict:
        """What a healing peer fetches (on torchft's quorum thread, while this process waits
        in the same quorum): this process's pieces of the state, bitwise, and the loader's
        position after its last committed step (not the batch of a discarded attempt, kept for
        the retry)."""
        began = time.time()
        wire = _exchange.to_wire(_exchange.to_host(self._state))
        if self._events is not None:   # the digest is for the record alone
            self._record("serve", step=self.step, digest=_exchange.digest(wire), began=began)
        return {"state": wire, "loader": self._position}

    def _load_state_dict(self, saved: dict) -> None:
        """A peer's state, placed as this group's own, for the next attempt; the loader moves
        to the peer's position."""
        began = time.perf_counter()
        self._healed = _exchange.from_host(self._state, _exchange.from_wire(saved["state"]))
        self._state = self._healed
        if self.loader is not None and saved["loader"] is not None:
            self.loader.load_state_dict(saved["loader"])
            self._position = saved["loader"]
            self._epochs, self._batch = None, None
        step = self._manager.current_step()
        # a fresh job's first quorum gives every group the same state: that is not a heal
        if step > 0 and self._events is not None:
            self._record("heal", step=step, digest=_exchange.digest(saved["state"]),
                         seconds=time.perf_counter() - self._began,
                         place_s=time.perf_counter() - began)

    def _record(self, event: str, **fields: Any) -> None:
        """One line of the group's events file (`jdp.job.events`), from its process 0."""
        if self._events is not None:
            _events.append(self._events, event, **fields)

    def close(self) -> None:
        """Leave the job: stop this process's torchft servers."""
        with contextlib.suppress(Exception):
            self._manager.shutdown(wait=False)

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sampler(num_examples: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
            group: int | None = None, groups: int | None = None) -> DistributedSampler:
    """A `DistributedSampler` over groups x processes: this process reads rank `group *
    process_count + process_index` of `groups * process_count`, so each group reads its
    own share of every step and no two groups read the same example."""
    require_job("jdp.ft.sampler")
    group, groups = _coords.group_of(group, groups, "jdp.ft.sampler")
    n = jax.process_count()
    return DistributedSampler(num_examples, num_replicas=groups * n,
                              rank=group * n + jax.process_index(), shuffle=shuffle, seed=seed,
                              drop_last=drop_last)


def _forever(loader: Any) -> Iterator:
    while True:
        yield from loader


def _floats(values: list) -> list:
    """Per leaf, its pieces when floating (exchanged as float32, or float64), else none."""
    out = []
    for pieces in values:
        dtype = pieces[0].dtype
        floating = np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"
        wire = np.float64 if dtype == np.float64 else np.float32
        out.append([v.astype(wire) for v in pieces] if floating else [])
    return out


def _merge(values: list, reduced: list) -> list:
    """Per leaf, the reduced pieces where it was exchanged, else its own."""
    return [r if r else v for v, r in zip(values, reduced, strict=True)]


def _error_line(error: Any) -> str:
    return str(getattr(error, "original_exception", error) or "").splitlines()[0][:200] \
        if error else ""
