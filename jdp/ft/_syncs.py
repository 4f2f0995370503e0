"""The semi-synchronous side of `jdp.ft.Replicas` (`sync_every=H`): LocalSGD, DiLoCo and
Streaming DiLoCo.

Each group takes its own steps (`_own_step`: the train step's two halves on its own state)
and every `sync_every / fragments` steps one fragment of the parameters syncs: a quorum, the
fragment's exchange started (`Pending`, an all-reduce on its own thread), merged `overlap`
steps later by `_outer.Outer` once every group's exchange succeeded (redone in new quorums
with the same values until one commits). With `overlap` the sync's quorum runs behind the
group's steps too (`Sender`): the group waits for the other groups only at the merge, when
they are more than `overlap` steps behind it. A group that comes back heals from a peer at one
of its syncs and joins that sync (`_join`): the peer's state comes in the turn under way
(`Replicas._turn`, which the heal writes), taken by the sync's exchange. `Syncs` holds these
steps as methods of `Replicas`, which inherits them: they run on its state, quorums and votes.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import jax

from jdp.ft import _buffers, _outer
from jdp.job import values as _values

WHO = "jdp.ft.Replicas"


class Syncs:
    """`Replicas`'s semi-synchronous steps (see the module docstring)."""

    def _rounds(self, turn: Any, num_steps: int) -> Iterator:
        """Semi-synchronous: the turn of each of the group's own steps, a sync after every
        `sync_every` of them and after the last (in the step, `_own_step`; `_outer.Outer.due`
        says when); a quorum only at a sync."""
        self._begin()
        while self._inner < num_steps:
            yield self._batched(turn)

    def _begin(self) -> None:
        """A semi-synchronous group's first quorum. A fresh job agrees on the lowest group's
        state and commits it (the start is a sync: a group that dies before the first real
        one heals like any other); a group coming back has healed from a peer at one of its
        syncs and takes part in that sync at once, as the peer does (`_join`)."""
        self._quorum()
        if self.step > 0:
            self._join()
        else:
            self._commit_start()

    def _commit_start(self) -> None:
        began = time.perf_counter()
        while True:
            state = self._initial(self._state)
            self._vote([])
            if self.committed:
                break
            self._discarded(time.perf_counter() - began, "its start")
            self._quorum()
        self._state, self._carry = state, self._outer.start(state)
        self.history.append((self.step, self.groups))
        self._committed(inner=0, seconds=time.perf_counter() - began)

    def _join(self) -> None:
        """The sync the healing peer was at (`_phase`, served with its state): its exchange,
        to which this group adds nothing, merged when the peer merges it."""
        if self._joined is None:
            raise RuntimeError("jdp.ft: this group healed from a peer that was at no sync")
        kind, fragment, merge_at, sent_at = self._joined
        self._start_exchange(fragment, merge_at, self._joined_sent, sent_at)
        if merge_at <= self._inner or self._inner >= self._num_steps:
            self._finish()
        if self._inner >= self._num_steps:   # the peer is at the run's end: so is this group
            self._final_syncs(fragment + 1 if kind == "final" else 0)

    def _own_step(self, whole: Any, turn: Any, batch: Any) -> tuple:
        """One of the group's own steps on the group's own state (a sync or a heal may have
        replaced it), with the halves of `whole` (a TrainStep); then the sync in flight merged
        when due, and a fragment's sync started when due (every fragment's at the run's last
        step)."""
        with self._serving:   # a heal served meanwhile (`Sender`) reads a whole step's state
            state = self._state
            grads, new_ms, metrics = whole.gradients(state, batch)
            self._state = whole.update(state, grads, new_ms)
            turn.batch, self._inner = None, self._inner + 1
            if self.loader is not None:   # what a group healing from this one reads next
                self._position = self.loader.state_dict()
        self.committed = True
        if self._pending is not None and self._inner >= self._pending.merge_at:
            self._finish()
        if self._inner >= self._num_steps:
            self._final_syncs(0)
        elif (fragment := self._outer.due(self._inner, self._num_steps)) is not None:
            self._send(fragment, self._outer.overlap)
        return self._state, metrics

    def _final_syncs(self, first: int) -> None:
        """The run's end: what is in flight merged, then every fragment from `first` synced
        without overlap, so every group ends with the same parameters."""
        self._finish()
        for fragment in range(first, self._outer.fragments):
            if self._send(fragment, 0, final=True):
                return   # joined the others' end, which syncs the rest

    def _send(self, fragment: int, overlap: int, final: bool = False) -> bool:
        """A quorum, then fragment `fragment`'s exchange started, merged after `overlap`
        more steps (at once for 0; with overlap, both behind the steps: `_send_behind`).
        True when torchft healed this group in the quorum (it was a sync behind): it then
        joined the sync the others are at instead."""
        merge_at = self._inner + overlap
        self._phase = ("final" if final else "send", fragment, merge_at, self._inner)
        if overlap and not final:
            self._send_behind(fragment, merge_at)
            return False
        self._quorum()
        if self._turn.healed is not None:
            self._join()
            return True
        self._start_exchange(fragment, merge_at)
        if overlap == 0:
            self._finish()
        return False

    def _start_exchange(self, fragment: int, merge_at: int, sent: Any = None,
                        sent_at: int | None = None) -> None:
        """This group's part of fragment `fragment`'s all-reduce, started (`Pending`). A
        group healed in this quorum adds zeros and is not counted: it holds the peer's state,
        which the peer adds itself."""
        healed = self._turn.healed is not None
        if healed:
            self._state, self._carry = self._turn.start(None)
        tree = self._outer.exchanged(self._state, self._carry, fragment)
        if sent is None:
            sent = self._outer.sent(self._state, fragment)
        if merge_at > self._inner:   # steps come first, and a step may donate the state
            tree, sent = _outer.copied((tree, sent))
        self._pending = Pending(fragment, merge_at, sent, tree, healed,
                                 self._inner if sent_at is None else sent_at)
        self._issue(self._pending)

    def _send_behind(self, fragment: int, merge_at: int) -> None:
        """The sync's quorum and its exchange's start on a thread (`Sender`) while the group
        takes its next steps: what it sends is taken now, so a heal served meanwhile gives the
        peer's fragment as sent with the state of the step it is at; a heal of this group is
        placed at the merge (`_finish`)."""
        tree = self._outer.exchanged(self._state, self._carry, fragment)
        sent = self._outer.sent(self._state, fragment)
        tree, sent = _outer.copied((tree, sent))
        pending = self._pending = Pending(fragment, merge_at, sent, tree, False, self._inner)
        self._flattened(pending)   # before the next step: the thread's copy waits for no step

        def behind() -> None:
            self._quorum()
            if self._stashed is None:
                self._started(pending)
        self._sender = Sender(behind)
        self._sender.start()

    def _await_sender(self) -> dict | None:
        """The sync's quorum and start behind the steps, waited for (the wait counts as
        blocked on the other groups; its error is raised here); the peer's state when this
        group healed in that quorum."""
        sender, self._sender = self._sender, None
        if sender is None:
            return None
        began = time.perf_counter()
        sender.join()
        self._blocked += time.perf_counter() - began
        if sender.error is not None:
            raise sender.error
        stashed, self._stashed = self._stashed, None
        return stashed

    def _issue(self, pending: Pending) -> None:
        self._flattened(pending)
        self._started(pending)

    def _flattened(self, pending: Pending) -> None:
        """The sync's buffers filled on the devices and their copies to the host started:
        dispatched, not waited for. Dispatched by the step loop ahead of its next step, so
        that the copy waits only for the step before it, not for steps taken meanwhile."""
        pending.plan = _buffers.Buffers.of(pending.tree, averaged(pending.tree),
                                           self._plans)
        pending.buffers = pending.plan.flatten(pending.tree)
        _buffers.copying(pending.buffers)

    def _started(self, pending: Pending) -> None:
        """The buffers on the host (zeros for a healed group, which adds nothing) and the
        all-reduce across groups started."""
        pending.host = _buffers.to_host(pending.buffers)
        if pending.healed:
            for t in pending.host:
                t.zero_()
        pending.reduce = self._allreduce_start(pending.host, member=not pending.healed)

    def _finish(self) -> None:
        """The sync in flight: its all-reduce waited for and voted on, redone in new quorums
        with the same values until one commits, then merged (`_outer.Outer.apply`)."""
        pending = self._pending
        if pending is None:
            return
        if (healed := self._await_sender()) is not None:   # behind a sync: as in a redo
            self._pending = None
            self._load_state_dict(healed)
            self._join()
            return
        while not self._vote_on(pending.reduce):
            self._discarded(time.perf_counter() - self._began, "the sync")
            self._phase = ("redo", pending.fragment, pending.merge_at, pending.inner)
            self._quorum()
            if self._turn.healed is not None:   # behind a sync the others committed meanwhile:
                self._pending = None       # healed, this group joins the sync they are at
                self._join()
                return
            self._issue(pending)
        mean = pending.plan.unflatten(_buffers.back(pending.buffers, pending.host),
                                      pending.tree, len(self.groups))
        self._state, self._carry = self._outer.apply(self._state, mean, self._carry,
                                                     pending.fragment, pending.sent)
        self._pending = None
        self.history.append((self.step, self.groups))
        self._committed(inner=pending.inner, merged=self._inner, fragment=pending.fragment,
                        seconds=time.perf_counter() - self._began)


def outer_of(sync_every: Any, outer: Any, fragments: Any, overlap: Any,
              state: Any) -> _outer.Outer | None:
    """`Replicas`'s `sync_every`, `outer`, `fragments` and `overlap`, checked."""
    if sync_every is None:
        if outer is not None or fragments != 1 or overlap != 0:
            raise ValueError("jdp.ft.Replicas: outer=, fragments= and overlap= need "
                             "sync_every=H (the steps between syncs); without it the groups "
                             "sum gradients every step")
        return None
    sync_every = _values.integer(WHO, "sync_every", sync_every, minimum=1,
                                 fix="the steps each group takes between syncs")
    if outer is not None and not (hasattr(outer, "init") and hasattr(outer, "update")):
        raise TypeError(f"jdp.ft.Replicas: outer={outer!r} is not an optax optimizer; pass "
                        "e.g. optax.sgd(0.7, momentum=0.9, nesterov=True), or None (LocalSGD)")
    leaves = len(jax.tree.leaves(getattr(state, "params", None)))
    fragments = _values.integer(WHO, "fragments", fragments, minimum=1,
                                maximum=max(1, min(sync_every, leaves)),
                                fix="at most sync_every and the parameters' leaves")
    if sync_every % fragments:
        raise ValueError(f"jdp.ft.Replicas: sync_every={sync_every} is not a multiple of "
                         f"fragments={fragments}; each fragment syncs every sync_every steps, "
                         "one every sync_every / fragments")
    stride = sync_every // fragments
    overlap = _values.integer(WHO, "overlap", overlap, minimum=0, maximum=stride - 1,
                              fix=f"fewer steps than between two fragments' syncs ({stride})")
    return _outer.Outer(sync_every, outer, fragments, overlap)


class Sender(threading.Thread):
    """`run` (a sync's quorum and exchange's start) on a thread of its own; what it raised is
    kept for the step loop (`Syncs._await_sender`)."""

    def __init__(self, run: Any):
        super().__init__(daemon=True, name="jdp-ft-sync")
        self._body, self.error = run, None

    def run(self) -> None:
        try:
            self._body()
        except BaseException as e:   # noqa: BLE001 - raised again in the step loop
            self.error = e


class Pending:
    """A fragment's sync under way: what was sent and when it merges, its buffers and the
    started all-reduce (`Syncs._issue`)."""

    def __init__(self, fragment: int, merge_at: int, sent: list, tree: tuple, healed: bool,
                 inner: int):
        self.fragment, self.merge_at, self.sent, self.tree = fragment, merge_at, sent, tree
        self.healed, self.inner = healed, inner
        self.plan: Any = None
        self.buffers: list = []
        self.host: list = []
        self.reduce: tuple = ()


def averaged(tree: Any) -> tuple:
    """Per leaf of a sync's exchange, divided by the groups' count: every one (a mean)."""
    return (True,) * len(jax.tree.leaves(tree))
