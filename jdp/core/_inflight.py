"""The user's own jitted step, kept safe: seen by the watchdog and bounded in flight.

A `jax.jit` / `nnx.jit` step on a `jdp.broadcast` state and `jdp.shard` / `Loader` batches is
data-parallel as it is (XLA partitions it over the mesh), but jdp never sees its calls. Its
batches pass through jdp, though, so they carry what `jdp.train_step` does for its own:

* progress: each batch handed out records phase "step" (the Loader also counts the steps), so
  `--progress_timeout` names a stuck rank and goodput counts step time, not start-up;
* a bound on the steps in flight: many queued multi-device steps whose collectives cross
  processes can deadlock the CPU runtime. When a batch is handed out, jdp notes the arrays
  still being computed (`jax.live_arrays` not yet ready: what the steps dispatched so far
  write) and waits until those noted `size` hand-outs back are computed, so step k waits for
  step k - size. The batches themselves are never touched: a program may keep every batch,
  some or none. When the noted arrays are all gone (donated to the next step, or dropped),
  it waits for those noted at this hand-out instead (the newest step: one in flight). Only
  on CPU, where the deadlock is; elsewhere the runtime queues steps safely.

Both stand aside while jdp's own steps run (`jdp.train_step`, `jdp.eval_step`,
`jdp.evaluate`), which record and bound themselves.
"""
from __future__ import annotations

import collections
import weakref
from typing import Any

import jax

from jdp.job import rank as _rank

SIZE = 2                  # steps in flight before the next batch waits, as jdp.train_step's


def jdp_step_called() -> None:
    """A jdp step was dispatched: it records progress and bounds itself (while jdp's own
    steps run, the batches stand aside)."""
    _rank.current().in_flight.jdp_calls += 1


class StepWindow:
    """Waits, as batches are handed out, for the arrays being computed `size` hand-outs back."""

    def __init__(self, size: int = SIZE):
        self.size = size
        self._noted: collections.deque = collections.deque()
        self._calls = _rank.current().in_flight.jdp_calls
        self._bounded: bool | None = None   # decided at the first hand-out (jax's backend)

    def handed(self, tree: Any, count: bool) -> None:
        """A batch goes to the program: record the step and wait for the step `size` back.

        Args:
            tree: the batch (global arrays); only its platform is looked at.
            count: count it as a training step (the Loader) or only as step-phase progress
                (`jdp.shard`, called once per field of a batch).
        """
        in_flight = _rank.current().in_flight
        calls, self._calls = self._calls, in_flight.jdp_calls
        if calls != self._calls:   # jdp's own steps consume these batches
            self._noted.clear()
            return
        if count:
            in_flight.own_steps += 1
        _rank.record("step", in_flight.own_steps if count else None)
        if self._bounded is None:
            self._bounded = _on_cpu(tree)
        if not self._bounded:
            return
        self._noted.append(_computing())
        if len(self._noted) >= self.size:
            _wait(self._noted.popleft(), self._noted[-1])


def _on_cpu(tree: Any) -> bool:
    """True when the batch lives on CPU devices (where queued cross-process steps can hang)."""
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    return bool(leaves) and all(d.platform == "cpu" for d in leaves[0].sharding.device_set)


def _computing() -> tuple[bool, list]:
    """(anything noted, weak references to the live arrays not yet computed)."""
    refs = [weakref.ref(x) for x in jax.live_arrays() if not x.is_deleted() and not x.is_ready()]
    return bool(refs), refs


def _alive(refs: list) -> list:
    return [x for r in refs if (x := r()) is not None and not x.is_deleted()]


def _wait(old: tuple[bool, list], new: tuple[bool, list]) -> None:
    """Wait for the arrays noted `size` hand-outs back; when they are all gone (donated to a
    later step, or dropped), for those noted now, which the later steps compute from them."""
    noted, refs = old
    if not noted:                # nothing was being computed then: that step was done
        return
    arrays = _alive(refs) or _alive(new[1])
    jax.block_until_ready(arrays)
