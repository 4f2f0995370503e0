"""`Replicas`: this replica group's side of a fault-tolerant job.

Each attempt at a step asks torchft for the quorum (the groups alive now), computes this
group's gradient (`jdp.train_step`'s first half on the group's own devices), sums the
gradients of the groups in the quorum over torchft's process group (`_buffers`: flat buffers
made on the devices, copied to the host and back once each), and commits
the update only if every group's all-reduce succeeded (torchft's `should_commit`). An attempt
that fails (a group died during it) is discarded by every survivor and redone with the same
batch in the next quorum. A group that comes back heals from a live peer before it computes.

Before they train together, the groups of every new quorum exchange their fingerprints
(`_fingerprint`, `_agreement`): a difference in what they built is named on every group and
stops the job. A group at step 0 trains only when `_start` says so: never from the initial
state while the job has gone on, never alone unless `min_groups` allows it. A group that
stopped for good records why (`_record`), so its launcher's restarts stop at once too.
With `sync_every` the groups sync every H steps instead: those steps are `_syncs.Syncs`'s.

One path drives the attempts: `_turns` holds each attempt's quorum and batch in a `_Turn`, and
`_take` runs the attempt on it. `Replicas.train` is that loop in one call; `batches` and
`train_step` are the same loop split between the caller's `for` and its step call, which hand
each other the turn.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jdp.core import train_step
from jdp.data import DistributedSampler
from jdp.distributed import broadcast_for, print0, require_job
from jdp.ft import (
    _agreement,
    _buffers,
    _coords,
    _exchange,
    _fingerprint,
    _manager,
    _network,
    _record,
    _start,
    _syncs,
)
from jdp.job import env as _env
from jdp.job import events as _events
from jdp.job import run as _run
from jdp.job import values as _values

START_TIMEOUT_S = 300.0   # a fresh job's first step waits this long for every group
NOTICE_S = 10.0           # and says so after this long
TELL_S = 10.0             # a difference seen at step 0 with groups missing: raised after this
                          # long (or once every group is here), so late groups see it too
POLL_S = 0.1              # between the quorums of a group that waits at step 0
WHO = _syncs.WHO


class Replicas(_syncs.Syncs):
    """This replica group among the job's groups: the quorum, the exchange, the heal.

    Args:
        state: the group's train state, as `jdp.broadcast` placed it (any layout); a group
            that heals replaces it with a live peer's.
        loader: a `jdp.data.Loader` over `jdp.ft.sampler(...)`: the group's share of every
            step; its position travels with a heal.
        group, groups, lighthouse: default: `JDP_REPLICA_GROUP`, `JDP_REPLICA_GROUPS`,
            `JDP_FT_LIGHTHOUSE` (set by `jdp.launch --replica_group G --replica_groups R
            --ft_lighthouse ...`).
        start_timeout: seconds a fresh job's first step waits for all `groups` to join;
            then the group stops with one line, unless `min_groups` allows fewer.
        min_groups: the fewest groups a fresh job may start with once a group has waited
            `start_timeout` (default: all `groups`: a job never starts with fewer by itself).
        quorum_timeout: seconds one quorum may take before the process raises; also how
            long a restarted group that finds nobody ahead of it waits for a live group to
            heal from before it stops.
        timeout: seconds an all-reduce, a commit vote or a state transfer may take before
            the attempt is discarded (what a group alive but stuck holds the others).
        setup_timeout: seconds the set-up of a new quorum's process group across the groups
            may take, a deadline (at most `timeout`), before the attempt is discarded: what a
            group that dies after a quorum counted it, before the set-up, adds to the others'
            stall. The set-up takes milliseconds on one machine; raise it where the groups'
            hosts take longer to connect.
        sync_every: None (default): the groups sum their gradients at every step. H: each
            group trains on its own for H steps, then the groups sync (`_outer`): LocalSGD,
            or DiLoCo with `outer`. A quorum, a heal and a discarded attempt happen at syncs
            only; `num_steps` counts the group's own steps, and the last one syncs too (in
            place of a sync it would follow within H steps: at most one model sent per H).
        outer: with `sync_every`, DiLoCo's outer optimizer (any optax one, e.g.
            `optax.sgd(0.7, momentum=0.9, nesterov=True)`), applied to the groups' mean of
            `anchor - params`; None: LocalSGD (the parameters averaged).
        fragments, overlap: with `sync_every`, Streaming DiLoCo's schedule: the parameters'
            leaves in `fragments` parts synced at staggered steps (one every `sync_every /
            fragments`), each sync's all-reduce running while the group takes `overlap`
            more steps (fewer than `sync_every / fragments`); `_outer` says how it merges.

    Example (in a script started by `jdp.launch --replica_group G ...`)::

        replicas = jdp.ft.Replicas(state, loader)
        for state, metrics in replicas.train(loss_fn, num_steps):
            ...

    or, the same attempts with the loop's halves in the caller's hands::

        step = replicas.train_step(loss_fn)
        for batch in replicas.batches(num_steps):
            state, metrics = step(state, batch)
    """

    _turn: _Turn | None = None   # the attempt under way: made by the first run, kept by the
                                 # next (a discarded attempt's batch is redone there)

    def __init__(self, state: Any, loader: Any = None, *, group: int | None = None,
                 groups: int | None = None, lighthouse: str | None = None,
                 start_timeout: float = START_TIMEOUT_S, quorum_timeout: float = 60.0,
                 timeout: float = _manager.OP_TIMEOUT_S,
                 setup_timeout: float = _manager.SETUP_TIMEOUT_S, min_groups: int | None = None,
                 sync_every: int | None = None, outer: Any = None, fragments: int = 1,
                 overlap: int = 0):
        require_job(WHO)
        self._outer = _syncs.outer_of(sync_every, outer, fragments, overlap, state)
        self._link = _network.link()   # an emulated slow link, checked now
        start_timeout, quorum_timeout, timeout, setup_timeout = (
            _values.seconds(WHO, name, value, maximum=_env.MAX_SECONDS, fix="a wait must end")
            for name, value in (("start_timeout", start_timeout),
                                ("quorum_timeout", quorum_timeout), ("timeout", timeout),
                                ("setup_timeout", setup_timeout)))
        self.coords = _coords.coordinates(group, groups, lighthouse)
        primary = jax.process_index() == 0
        self._events = self.coords.events if primary else None   # the group's record
        self._me = _start.Me(self.coords.group, self.coords.groups,
                             self._min_groups(min_groups), start_timeout, quorum_timeout,
                             self._past())
        self._state, self.loader = state, loader
        self._position = loader.state_dict() if loader is not None else None
        self.start_timeout = start_timeout
        self._quorum_timeout = quorum_timeout
        self._fields, self._problem = self._set_up(state, loader)
        # DiLoCo's anchor and outer state (semi-synchronous; placed now, as a heal's template)
        self._carry: tuple = self._outer.start(state) if self._outer is not None else ()
        self._fields["sync"] = self._sync_text()
        self._inner = 0               # this group's own steps done (semi-synchronous)
        self._pending: _syncs.Pending | None = None   # the sync whose all-reduce is in flight
        self._sender: _syncs.Sender | None = None     # its quorum, when behind the steps
        self._stashed: dict | None = None     # a peer's state healed from in that quorum
        self._serving = threading.Lock()      # held by a step, and by a heal served meanwhile
        # (kind, fragment, merge_at, sent_at) of the sync under way, served to a heal; a
        # peer's, healed from, and the fragment that peer sent
        self._phase: tuple | None = None
        self._joined: tuple | None = None
        self._joined_sent: Any = None
        self._num_steps = 0
        self._train: Any = None       # the last TrainStep made: the warm-up compiles its halves
        self._handed: _Turn | None = None   # batches' turn, for the step call (`train_step`)
        self._plans: dict = {}        # the exchange's buffer plans, by tree (`_buffers`)
        self._epochs: Iterator | None = None
        self._began = 0.0             # when the attempt began (its quorum)
        self._blocked = 0.0           # seconds in quorums and exchanges since the last commit
        self._checked: Any = None     # the quorum whose fingerprints were compared last
        self._members: list = []      # the groups of that quorum
        self._verdict: str | None = None      # a difference seen at step 0, to raise
        self._mismatch: str | None = None     # a heal's state that did not fit this group's
        self._told: float | None = None       # when this group first saw the verdict
        self._said_fewer = False
        self.history: list = []       # (step, groups) of every step this group committed
        self.sent = 0                 # bytes this process put into cross-group all-reduces
        self.groups: list = []        # the groups of the last attempt's all-reduce
        self.committed: bool | None = None
        self.torchft_log = _manager.torchft_log(self.coords.events, jax.process_index())
        self._timeouts = quorum_timeout, timeout, setup_timeout
        self._manager: Any = None     # torchft's, made when the group is ready (`_connect`)
        self._pg = self._store = None
        self._record("join", group=self.coords.group, pid=os.getpid(),
                     restart=int(os.environ.get(_env.RESTART_COUNT, 0)), past=self._me.past)

    def _connect(self) -> None:
        """Start this process's torchft manager, which heartbeats to the Lighthouse: only
        once the group can ask for a quorum within milliseconds (its step compiled). The
        Lighthouse waits up to its join timeout for a heartbeating group that has not
        asked, and forms no quorum of half the heartbeating groups or fewer: a group that
        heartbeat while it compiled could hold the survivors of a kill that long."""
        if self._manager is None:
            self._manager, self._pg, self._store = self._torchft(*self._timeouts)
            self._record("connect")

    def _torchft(self, quorum_timeout: float, timeout: float, setup_timeout: float) -> tuple:
        """`_manager.manager`, with a Lighthouse that does not answer named in one line: a
        group that had trained under it stops for good (exit 78), as no restart reaches it."""
        try:
            return _manager.manager(self.coords, self._state_dict, self._load_state_dict,
                                    quorum_timeout, timeout, setup_timeout)
        except RuntimeError as e:
            line = _manager.unreachable(e, self.coords.lighthouse, self._me.past)
            if line is None:
                raise
            raise (_final(line) if self._me.past > 0 else RuntimeError(line)) from None

    def _sync_text(self) -> str:
        """The fingerprint's "sync": every step, or how and how often, and DiLoCo's outer
        optimizer state (another outer optimizer is named, not met at a heal)."""
        if self._outer is None:
            return "every step"
        if not self._carry:
            return self._outer.describe()
        return f"{self._outer.describe()}, outer {_fingerprint.tree_text(self._carry[1])}"

    def _min_groups(self, min_groups: int | None) -> int:
        if min_groups is None:
            return self.coords.groups
        return _values.integer(WHO, "min_groups", min_groups, minimum=1,
                               maximum=self.coords.groups,
                               fix="the fewest replica groups a fresh job may start with")

    def _past(self) -> int:
        """The steps this group's record shows it committed before its restart (the same on
        every process of the group); a group that had stopped for good stops again, at once,
        before it reaches the Lighthouse."""
        restart = int(os.environ.get(_env.RESTART_COUNT, 0) or 0)
        past = _record.past(self._events, restart)
        if past.stopped:
            raise _final(f"{past.stopped} (this group stopped for it before its restart; "
                         "a restart cannot change it)")
        if jax.process_count() == 1:
            return past.steps
        return int(broadcast_for(np.int64(past.steps), WHO))

    def _set_up(self, state: Any, loader: Any) -> tuple:
        """The fingerprint's fields known at the start (`_fingerprint`), and a problem of
        this group's own (a sampler that is not jdp.ft.sampler's), named on every group."""
        fields = {**_fingerprint.of_job(self.coords.groups, jax.process_count(),
                                        jax.device_count(), self._me.min_groups),
                  **_fingerprint.of_state(state)}
        data, problem = _fingerprint.of_loader(loader, self.coords.group, self.coords.groups,
                                               jax.process_count(), jax.process_index())
        self._state_fields = {k: fields[k] for k in _fingerprint.STATE_FIELDS if k in fields}
        return {**fields, **data, "options": None, "num_steps": None}, problem

    @property
    def step(self) -> int:
        """Steps committed so far (the same on every group in the quorum; 0 before the
        group's first quorum)."""
        return self._manager.current_step() if self._manager is not None else 0

    @property
    def inner_steps(self) -> int:
        """With `sync_every`: this group's own steps so far (its position in `num_steps`)."""
        return self._inner

    @property
    def state(self) -> Any:
        """The latest state: after a heal, the peer's."""
        return self._state

    def train(self, loss_fn: Callable, num_steps: int, **options: Any) -> Iterator[tuple]:
        """Train until `num_steps` are committed (with `sync_every`: the group's own steps),
        the whole loop in one call: for each attempt the quorum (a heal when this group comes
        back), the loader's next batch (the same again after a discarded attempt), then
        `jdp.train_step(loss_fn, **options)` on the group's own state, its gradient summed over
        the quorum's groups. Yields `(state, metrics)` after every attempt: a discarded one's
        state is the one it started from (`replicas.committed` is False). The same attempts as
        `train_step`'s step called in `batches`' loop, with no step call to pair with each
        batch and no state to pass back."""
        num_steps = _num_steps("train", num_steps)
        whole = self._made(loss_fn, options)
        for turn in self._turns(num_steps, "train"):
            yield self._take(whole, turn, self._state, turn.batch)

    def train_step(self, loss_fn: Callable, **options: Any) -> Callable:
        """`jdp.train_step(loss_fn, **options)` whose gradient is summed over the groups in
        the quorum: `step(state, batch) -> (state, metrics)`, called once per batch of
        `batches` (`train` runs both in one loop). A discarded attempt returns the state it
        was given (`replicas.committed` is False); after a heal the step starts from the
        peer's state, whatever state it is given. With `sync_every` every step goes on from
        the group's own state (`replicas.state`), which syncs and heals replace; pass back
        the state the step returned."""
        whole = self._made(loss_fn, options)

        def step(state, batch):
            turn, self._handed = self._handed, None
            if turn is None:
                raise RuntimeError(
                    "Replicas: the step ran outside `for batch in replicas.batches(num_steps)`"
                    f", which holds each step's {'quorum' if self._outer is None else 'place'}")
            return self._take(whole, turn, state, batch)
        return step

    def batches(self, num_steps: int) -> Iterator:
        """The group's batch of each step until `num_steps` are committed, for exactly one
        call of the step from `train_step`: a quorum before each (a heal when this group
        comes back), and the same batch again after a discarded attempt (`_turns`)."""
        num_steps = _num_steps("batches", num_steps)
        for turn in self._turns(num_steps, "batches"):
            self._handed = turn
            try:
                yield turn.batch
            finally:
                missed, self._handed = self._handed is not None, None
            if missed:
                raise RuntimeError("Replicas.batches: a batch went by without a step; call "
                                   "the step from replicas.train_step once per batch")

    def _made(self, loss_fn: Callable, options: dict) -> Any:
        """`jdp.train_step(loss_fn, **options)`, whose halves the attempts run (the sum across
        groups between them); its options go into the fingerprint."""
        self._train = train_step(loss_fn, **options)
        self._fields["options"] = _fingerprint.of_options(options)
        return self._train

    def _turns(self, num_steps: int, who: str) -> Iterator[_Turn]:
        """The turn of each attempt until `num_steps` are committed, yielded with its quorum
        held and its batch taken (semi-synchronous: of each of the group's own steps,
        `_rounds`). Before the first quorum the step is compiled on the first batch
        (`_warm_up`), and only then does the group make itself known to the Lighthouse
        (`_connect`), so the other groups never wait for its compilation."""
        if self.loader is None:
            raise ValueError(f"Replicas.{who}: no loader; pass Replicas(state, loader) with a "
                             "jdp.data.Loader over jdp.ft.sampler(len(source))")
        self._fields["num_steps"] = str(num_steps)
        self._num_steps = num_steps
        if self._turn is None:
            self._turn = _Turn()
        turn = self._turn
        self._warm_up(turn)
        self._connect()
        if self._outer is not None:
            yield from self._rounds(turn, num_steps)
            return
        while self.step < num_steps:
            self._quorum()
            yield self._batched(turn)

    def _batched(self, turn: _Turn) -> _Turn:
        """`turn` with its batch: the one kept from a discarded attempt, else the next."""
        if turn.batch is None:
            turn.batch = self._next_batch()
        return turn

    def _take(self, whole: Any, turn: _Turn, state: Any, batch: Any) -> tuple:
        """One attempt on `turn` with the halves of `whole` (a TrainStep): synchronous
        (`_attempt`), or one of the group's own steps (`_own_step`)."""
        if self._outer is not None:
            return self._own_step(whole, turn, batch)
        return self._attempt(whole, turn, state, batch)

    def _warm_up(self, turn: _Turn) -> None:
        """Compile this group's step before its first quorum (the step from `train_step`,
        on the first batch: one gradient computed and dropped, the exchange's buffers made
        and unmade on the devices, the update compiled alone, as it donates the state). A
        group that joins a running job, or comes back to it, then computes its first
        attempt at once: the others no longer wait in the all-reduce for its compilation
        (seconds on a CPU; past `timeout`, a discarded step)."""
        if self._train is None or turn.batch is not None:
            return
        gradients, update = self._train.gradients, self._train.update
        turn.batch = self._next_batch()   # the first step's (a heal replaces it)
        tree = gradients(self._state, turn.batch)
        plan = _buffers.Buffers.of(tree, _divided(tree, self._train.options.mean), self._plans)
        grads, new_model_state, _ = plan.unflatten(plan.flatten(tree), tree, 1)
        update.lower(self._state, grads, new_model_state).compile()
        for fragment in range(self._outer.fragments if self._outer is not None else 0):
            tree = self._outer.exchanged(self._state, self._carry, fragment)   # the syncs'
            plan = _buffers.Buffers.of(tree, _syncs.averaged(tree), self._plans)
            mean = plan.unflatten(plan.flatten(tree), tree, 1)
            self._outer.apply(self._state, mean, self._carry, fragment,
                              self._outer.sent(self._state, fragment))

    def _next_batch(self) -> Any:
        if self._epochs is None:
            self._epochs = _forever(self.loader)
        return next(self._epochs)

    def _quorum(self) -> None:
        """torchft's quorum for the next attempt. The first attempt of a new quorum compares
        the groups' fingerprints first; at step 0 every quorum does, and the group trains
        only when `_start` says so (it waits, polling quorums, or stops)."""
        began, noticed = time.monotonic(), False
        while True:
            self._start_quorum()
            if self.step > 0 and not self._new_quorum():
                return
            rows = self._hello(time.monotonic() - began)
            if self.step > 0:
                return
            waited = time.monotonic() - began
            if self._agreed(self._decide(rows, waited)):
                return
            if rows is not None and not noticed and waited > NOTICE_S:
                noticed = True
                print0(_start.waiting(rows, self._me), file=sys.stderr)
            time.sleep(POLL_S)

    def _vote(self, host: list, member: bool = True) -> None:
        """The all-reduce of `host` and torchft's commit vote (`_vote_on`)."""
        self._vote_on(self._allreduce_start(host, member))

    def _vote_on(self, reduce: tuple) -> bool:
        """An all-reduce started by `_allreduce_start` waited for, then torchft's commit vote:
        `groups`, `committed`; the seconds they took count as blocked on the other groups."""
        began = time.perf_counter()
        try:
            self.groups = self._allreduce_wait(*reduce)
            self.committed = self._manager.should_commit()
        finally:
            self._blocked += time.perf_counter() - began
        return self.committed

    def _start_quorum(self) -> None:
        self._began = time.perf_counter()
        try:
            self._manager.start_quorum()
            _network.hold(_network.quorum_at(self._link, self._began))
        except TimeoutError as e:
            raise TimeoutError(
                f"jdp.ft: no quorum within quorum_timeout={self._quorum_timeout:g} s from "
                f"the Lighthouse at {self.coords.lighthouse}: is it running and reachable? "
                "(its launcher then restarts this group's processes, --max_restarts)") from e
        finally:
            if threading.current_thread() is not self._sender:   # not behind the steps
                self._blocked += time.perf_counter() - self._began

    def _new_quorum(self) -> bool:
        """Is this quorum one whose fingerprints this group has not compared? Every group of
        a quorum gets the same id from the Lighthouse, and a new one whenever its members
        change or an attempt failed, so all of them exchange at the same attempt. The id is
        torchft's private `Manager._quorum_id`; without it, every attempt exchanges (the
        same on every group, so still consistent)."""
        quorum = getattr(self._manager, "_quorum_id", None)
        return quorum is None or quorum != self._checked

    def _hello(self, waited: float) -> list | None:
        """Every group's row of this quorum (`_agreement.exchange`); a difference between
        them stops every group with the same line. None when the exchange failed."""
        self._checked = getattr(self._manager, "_quorum_id", None)
        row = {"group": self.coords.group, "fp": self._fields, "problem": self._problem,
               "step": self.step, "past": self._me.past,
               "ready": _start.ready(self._me, waited)}
        rows = _agreement.exchange(self._manager, self._pg, row)
        if rows is not None:
            self._members = sorted(r["group"] for r in rows)
        found = _fingerprint.difference(rows) if rows is not None else None
        self._verdict = found or self._mismatch or self._verdict
        if self._verdict is not None:   # seen now, or before the exchange failed
            self._judge(rows or [])
        return rows

    def _judge(self, rows: list) -> None:
        """Stop with the verdict: at once, except at step 0 with groups still missing, where
        it waits TELL_S (polling) so that groups starting a little later name it too."""
        if self.step > 0 or len(rows) >= self.coords.groups:
            self._stop(self._verdict)
        if self._told is None:
            self._told = time.monotonic()
        if time.monotonic() - self._told > TELL_S:
            self._stop(self._verdict)

    def _decide(self, rows: list | None, waited: float) -> bool:
        """Whether this group trains now (step 0): `_start.decide` on the quorum's rows; a
        verdict to stop stops it. A failed exchange waits for the next quorum, for
        `start_timeout` (or `quorum_timeout`, the longer) at most."""
        if rows is None and waited > max(self.start_timeout, self._quorum_timeout):
            self._stop(f"jdp.ft: replica group {self.coords.group} could not exchange with the "
                       f"groups of its quorums for {waited:.0f} s (the last error: "
                       f"{_error_line(self._manager.errored()) or 'none'}); check that the "
                       "groups' machines reach each other")
        if rows is None or self._verdict is not None:
            return False
        verdict = _start.decide(rows, self._me, waited)
        if verdict not in (_start.GO, _start.WAIT):
            self._stop(verdict)
        if verdict == _start.GO and len(rows) < self.coords.groups and not self._said_fewer:
            self._said_fewer = True
            print0(_start.fewer(rows, self._me), file=sys.stderr)
        return verdict == _start.GO

    def _agreed(self, go: bool) -> bool:
        """Process 0's decision on every process of the group: they run the same attempt
        (their exchanges may differ when one of them failed)."""
        if jax.process_count() == 1:
            return go
        return bool(broadcast_for(np.int32(go), WHO))

    def _stop(self, line: str) -> None:
        """End this group for good: the line in its record (a restart stops at once with it,
        `_past`), then raised."""
        self._record(_record.STOP, step=self.step, reason=line)
        raise _final(line)

    def _attempt(self, whole: Any, turn: _Turn, state: Any, batch: Any) -> tuple:
        """A synchronous attempt: the gradient, its sum over the quorum's groups, the vote,
        and the update only if every group committed (the turn's batch then done)."""
        state = turn.start(state)
        if self.step == 0:
            state = self._initial(state)
        grads, new_ms, metrics = whole.gradients(state, batch)
        tree = (grads, new_ms, metrics)
        plan = _buffers.Buffers.of(tree, _divided(tree, whole.options.mean), self._plans)
        buffers = plan.flatten(tree)
        host = _buffers.to_host(buffers)
        self._vote(host)
        seconds = time.perf_counter() - self._began
        if not self.committed:
            self._discarded(seconds)
            return state, metrics
        grads, new_ms, metrics = plan.unflatten(_buffers.back(buffers, host), tree,
                                                len(self.groups))
        self._state = whole.update(state, grads, new_ms)
        turn.batch = None
        if self.loader is not None:   # the batches of the committed steps, all handed out
            self._position = self.loader.state_dict()
        self.history.append((self.step, self.groups))
        self._committed(seconds=seconds)
        return self._state, metrics

    def _committed(self, **fields: Any) -> None:
        """Record a commit: its groups, the seconds blocked on the others since the last one
        (quorums, all-reduces, votes), the bytes this process has sent in all."""
        self._record("commit", step=self.step, groups=self.groups, **fields,
                     blocked=self._blocked, sent=self.sent)
        self._blocked = 0.0

    def _initial(self, state: Any) -> Any:
        """A fresh job's first step: every group takes the state of the quorum's lowest
        group, bitwise (`_agreement.initial_state`), so groups that initialised differently
        still train one model. A failed transfer leaves the state (the attempt is
        discarded)."""
        first = (self._members or [self.coords.group])[0]
        source = first == self.coords.group
        got = _agreement.initial_state(self._manager, self._pg, _exchange.to_host(state), source)
        if got is None:
            return state
        self._record("start", groups=self._members, source=first)
        if source:
            return state
        self._state = _exchange.from_host(state, got)
        return self._state

    def _discarded(self, seconds: float, what: str = "") -> None:
        """Record a discarded attempt and say so in one line (torchft's tracebacks of it go
        to its own log, `torchft_log`)."""
        why = _error_line(self._manager.errored()) or "a process of this group failed it"
        self._record("discard", step=self.step + 1, groups=self.groups, seconds=seconds,
                     error=why)
        redo = (f"it redoes {what} in the next quorum" if what else
                "it redoes the step with the same batch in the next quorum")
        print0(f"jdp.ft: group {self.coords.group} discarded its attempt at step "
               f"{self.step + 1} (groups {self._members}): {why}; {redo}", file=sys.stderr)

    def _allreduce_start(self, host: list, member: bool = True) -> tuple:
        """`host`'s tensors' sum over the quorum's groups, in place, started: a one-hot row of
        this group's index (zeros when not a `member` of the sum) rides in the same
        all-reduce, so the sum names the groups in it. Returns what `_allreduce_wait` takes."""
        import torch
        row = np.zeros(self.coords.groups, np.float32)
        row[self.coords.group] = float(member)
        tensors = [*host, torch.from_numpy(row)]
        began = time.perf_counter()
        total = _manager.Sum(self._manager, self._pg, tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.sent += nbytes
        return total, row, began, nbytes

    def _allreduce_wait(self, total: _manager.Sum, row: np.ndarray, began: float,
                        nbytes: int) -> list:
        """The groups in a started all-reduce's sum, once it ended (and the emulated link
        would have carried it, `_network`). A failed one (a group died during it) has closed
        this process's links (`_manager.Sum`)."""
        if total.wait():
            _network.hold(_network.ready_at(self._link, began, nbytes, int(row.sum() or 1)))
        return [int(i) for i in np.flatnonzero(row > 0.5)]

    def _state_dict(self) -> dict:
        """What a healing peer fetches (on torchft's quorum thread, while this process waits
        in the same quorum): this process's pieces of the state, bitwise, the loader's
        position after its last committed step (not the batch of a discarded attempt, kept for
        the retry), and the state's fingerprint, checked before the state is placed. A
        semi-synchronous group whose sync runs behind its steps serves the state between two
        of them (`_serving`), with its own steps done and the fragment as it sent it."""
        began = time.time()
        with self._serving:
            wire = _exchange.to_wire(_exchange.to_host(self._healable()))
            sent = None if self._pending is None else _exchange.to_wire(
                _exchange.to_host(self._pending.sent))
            served = {"state": wire, "loader": self._position, "fingerprint": self._state_fields,
                      "inner": self._inner, "phase": self._phase, "sent": sent}
        if self._events is not None:   # the digest is for the record alone
            self._record("serve", step=self.step, digest=_exchange.digest(wire), began=began)
        return served

    def _healable(self) -> Any:
        """What a heal moves: the state, and when semi-synchronous the carry of the last
        sync (`_outer`)."""
        return self._state if self._outer is None else (self._state, self._carry)

    def _load_state_dict(self, saved: dict) -> None:
        """A peer's state, placed as this group's own, for the next attempt; the loader moves
        to the peer's position. A state of another tree or layout is not placed: the
        fingerprints' exchange that follows names the difference on every group."""
        began = time.perf_counter()
        self._mismatch = _fingerprint.heal_difference(saved.get("fingerprint"),
                                                      self._state_fields)
        if self._mismatch is not None:
            return
        if threading.current_thread() is self._sender:   # the steps go on: placed at the merge
            self._stashed = saved
            return
        healed = self._turn.healed = _exchange.from_host(self._healable(),
                                                         _exchange.from_wire(saved["state"]))
        if self._outer is None:
            self._state = healed
        else:
            (self._state, self._carry), self._inner = healed, saved["inner"]
            self._joined = saved["phase"]
            self._joined_sent = None if saved["sent"] is None else _exchange.from_host(
                self._outer.sent(self._state, self._joined[1]),
                _exchange.from_wire(saved["sent"]))
        if self.loader is not None and saved["loader"] is not None:
            self.loader.load_state_dict(saved["loader"])
            self._position = saved["loader"]
            self._epochs, self._turn.batch = None, None
        step = self._manager.current_step()
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
        if self._manager is not None:
            with contextlib.suppress(Exception):
                self._manager.shutdown(wait=False)

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Turn:
    """The attempt under way, in one place: its batch, kept until an attempt on it commits
    (a discarded attempt is redone on it), and the peer's state this group healed from in
    the attempt's quorum, which the attempt starts from (with the carry when
    semi-synchronous). `_turns` makes it (once: a later run goes on with it) and yields it
    for each attempt once its quorum is held; torchft's heal (`Replicas._load_state_dict`,
    during that quorum) writes into it."""

    def __init__(self) -> None:
        self.batch: Any = None
        self.healed: Any = None

    def start(self, state: Any) -> Any:
        """The state the attempt starts from: the healed peer's (taken), else `state`."""
        healed, self.healed = self.healed, None
        return state if healed is None else healed


def _final(line: str) -> RuntimeError:
    """The error of a group that stops for good (its set-up differs from the other groups',
    or it has no live group to heal from): its rank exits with `jdp.job.run.FINAL_EXIT`
    (78), which the launcher does not restart, since a restart could not change it."""
    error = RuntimeError(line)
    error.jdp_exit_code = _run.FINAL_EXIT
    return error


def sampler(num_examples: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
            group: int | None = None, groups: int | None = None) -> DistributedSampler:
    """A `DistributedSampler` over groups x processes: this process reads rank `group *
    process_count + process_index` of `groups * process_count`, so each group reads its
    own share of every step and no two groups read the same example."""
    who = "jdp.ft.sampler"
    require_job(who)
    shuffle = _values.flag(who, "shuffle", shuffle, fix="True permutes each epoch")
    drop_last = _values.flag(who, "drop_last", drop_last,
                             fix="True drops the tail that does not split evenly")
    group, groups = _coords.group_of(group, groups, who)
    n = jax.process_count()
    return DistributedSampler(num_examples, num_replicas=groups * n,
                              rank=group * n + jax.process_index(), shuffle=shuffle, seed=seed,
                              drop_last=drop_last)


def _num_steps(who: str, num_steps: Any) -> int:
    """`num_steps` of `Replicas.train` or `Replicas.batches`, checked."""
    return _values.integer(f"jdp.ft.Replicas.{who}", "num_steps", num_steps, minimum=1,
                           fix="the number of steps to commit")


def _forever(loader: Any) -> Iterator:
    while True:
        yield from loader


def _divided(tree: tuple, mean: bool) -> tuple:
    """Per leaf of `(grads, new_model_state, metrics)`, whether its sum over the groups is
    divided by their count: the gradients' when `grad_reduce="mean"`, the others' always."""
    grads, *rest = (len(jax.tree.leaves(t)) for t in tree)
    return (mean,) * grads + (True,) * sum(rest)


def _error_line(error: Any) -> str:
    """The first line of torchft's error, without gloo's source location
    ("[.../pair.cc:537] "), at most 160 characters ("" for none)."""
    if not error:
        return ""
    text = (str(getattr(error, "original_exception", error)).splitlines() or [""])[0]
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)[:160]
