"""The per-call path of every jdp step, kept to what `jax.jit`'s own dispatch costs.

A step call records progress for the launcher's watchdog, hands over a cached stop flag, and
dispatches the compiled step; nothing walks the state or the batch in Python. The input
checks (`check(state, batch)`) run only while the transform traces, that is once per new
input signature, where jit does its own work. Run-ahead is bounded: once more than
`max_in_flight` steps are queued, the call waits for the oldest.
"""
from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jdp.core import _inflight, _inputs
from jdp.distributed import agree
from jdp.job import rank as _rank
from jdp.metrics import profile as _profile


class Step:
    """`step(state, batch)`: `transform(body)(state, batch, stop) -> (out, done)`, dispatched.

    A call reads top to bottom: refuse a donated state, announce the call (the agreement
    point), record progress, run the compiled step (checking the inputs only while it traces),
    and bound the steps in flight. `lower(state, batch)` lowers it as a call would run it.

    Args:
        body: the step on global (or stacked) inputs; returns its outputs and one small array
            that is ready when the step is (a train step's agreed stop flag). None for a
            subclass whose `_traced` is the body itself.
        check: `check(state, batch)` on the concrete inputs of a call that traces.
        transform: `jax.jit` or `jax.pmap` with the step's options (donation); what it
            returns is called and has `lower`.
        place_stop: `place_stop(flag) -> array`, the per-device stop flag the body takes.
        max_in_flight: steps dispatched ahead before the call waits for the oldest.
        train: a train step (counts steps, hands the agreed stop flag to `jdp.preempted`).
        donate: the transform donates the state; a call with a state whose buffers went to an
            earlier step is then refused (XLA would crash on it). A donated state has every
            leaf deleted, so its step counter alone tells.
        announce: `announce(n)` before the n-th call is dispatched: the agreement point that
            names a process skipping the call (`collective_call`).
        after: `after(state, out)` once a call is dispatched, on its inputs' state and its
            outputs (a check of what the step returned, which may take entries out of it).
    """

    def __init__(self, body: Callable | None, check: Callable, transform: Callable,
                 place_stop: Callable, *, max_in_flight: int, train: bool,
                 donate: bool = False, announce: Callable[[int], None] | None = None,
                 after: Callable[[Any, Any], None] | None = None) -> None:
        self._body, self._check, self._place_stop = body, check, place_stop
        self.max_in_flight, self.train, self.donate = max_in_flight, train, donate
        self._announce, self._after = announce, after
        self._phase = "step" if train else "eval"
        self._compiled = transform(self._traced)
        self._tracing: tuple | None = None   # the concrete inputs of the call under way
        self._stops: dict = {}                # stop flag -> its placed per-device array
        self._pending: collections.deque = collections.deque()
        self.calls = 0

    def __call__(self, state: Any, batch: Any) -> Any:
        if self.donate and _deleted(getattr(state, "step", None)):
            _inputs.not_donated(state)
        self.calls = calls = self.calls + 1
        if self._announce is not None:
            self._announce(calls)
        _inflight.jdp_step_called()
        # Before dispatching: a rank blocked in step k shows step k. Evaluations count no steps.
        _rank.record(self._phase, calls if self.train else None)
        window = _profile.before_step(calls) if self.train else None   # the profiler's
        self._tracing = (state, batch)   # checked by `_traced` if the call traces
        try:
            if window is None:
                out, done = self._compiled(state, batch, self._stop_array())
            else:
                with window:
                    out, done = self._compiled(state, batch, self._stop_array())
        except Exception:
            self._check(state, batch)  # inputs the transform refused before tracing: say why
            raise
        finally:
            self._tracing = None
        if window is not None:
            _profile.after_step(calls, done)
        if self._after is not None:
            self._after(state, out)
        pending = self._pending
        pending.append(done)
        if len(pending) > self.max_in_flight:
            _settle(pending.popleft(), self.train)
        return out

    def lower(self, state: Any, batch: Any) -> Any:
        """The step lowered for these inputs (checked as a first call's are)."""
        self._tracing = (state, batch)
        try:
            return self._compiled.lower(state, batch, self._stop_array())
        finally:
            self._tracing = None

    def _traced(self, state: Any, batch: Any, stop: Any) -> Any:
        """What the transform traces: the inputs checked, then the body."""
        self._check_traced()
        return self._body(state, batch, stop)

    def _check_traced(self) -> None:
        """Check the inputs of the call under way (the transform traces only at a new
        signature: nothing is checked on the calls that reuse a compiled step)."""
        if self._tracing is not None:
            self._check(*self._tracing)

    def _stop_array(self) -> Any:
        flag = _rank.current().stop.flag()
        if flag not in self._stops:
            self._stops[flag] = self._place_stop(flag)
        return self._stops[flag]


def collective_call(topic: str, who: str, every_call: bool, **options: Any) -> Callable:
    """`announce` for a `Step`: an agreement point (`jdp.distributed.agree`) at the first
    call (`every_call`: at every call) where every process must pass the same `options`, so a
    process that skips the call, or built the step with other options, is named on every
    process. A train step announces its first call only: nothing per step after it."""
    facts = [(name, str(value)) for name, value in options.items()]
    fix = f"build {who} with the same options on every process and call it on every process"

    def announce(call: int) -> None:
        if call == 1 or every_call:
            agree(topic, facts, who, fix)
    return announce


def _deleted(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and leaf.is_deleted()


def _settle(done: jax.Array, train: bool) -> None:
    """Wait for an old step; a train step's agreed stop flag goes to `jdp.preempted()`, which
    reads it only when asked.

    Every rank waits on the same step at the same call, so the flag it reads there is the
    same on every rank.
    """
    done.block_until_ready()
    if train:
        flag = lambda: float(np.asarray(done.addressable_data(0)).reshape(-1)[0]) > 0  # noqa: E731
        _rank.current().stop.set_agreed(flag)


def stop_values(flag: bool, devices: int) -> np.ndarray:
    """This process's per-device stop flags, as host values."""
    return np.full(devices, float(flag), np.float32)
