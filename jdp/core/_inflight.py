"""The user's own jitted step, kept safe: seen by the watchdog and bounded in flight.

A `jax.jit` / `nnx.jit` step on a `jdp.broadcast` state and `jdp.shard` / `Loader` batches is
data-parallel as it is (XLA partitions it over the mesh), but jdp never sees its calls. Its
batches pass through jdp, though, so they carry what `jdp.train_step` does for its own:

* progress: each batch handed out records phase "step" (the Loader also counts the steps), so
  `--progress_timeout` names a stuck rank and goodput counts step time, not start-up;
* a bound on the steps in flight: many queued multi-device steps whose collectives cross
  processes can deadlock the CPU runtime. When a batch is handed out, the batch handed out
  `size` batches earlier is released by donating its arrays to an identity computation, which
  the runtime runs only after every computation that read them; so step k waits for step
  k - size. A batch the program still holds (it keeps a reference) is left alone.

Both stand aside while jdp's own steps run (`jdp.train_step`, `jdp.eval_step`,
`jdp.evaluate`), which record and bound themselves.
"""
from __future__ import annotations

import collections
import sys
import warnings
from typing import Any

import jax

from jdp.job import progress as _progress

SIZE = 2                  # steps in flight before the next batch waits, as jdp.train_step's
_jdp_calls = [0]          # calls of jdp's own steps: while they run, batches stand aside
_steps = [0]              # own steps counted (the Loader's batches)
# The identity whose donated input the runtime hands over only once its readers are done.
_release = jax.jit(lambda leaves: leaves, donate_argnums=0)


def jdp_step_called() -> None:
    """A jdp step was dispatched: it records progress and bounds itself."""
    _jdp_calls[0] += 1


class Window:
    """The last `size` batches handed out, released (waited for) as newer ones go out."""

    def __init__(self, size: int = SIZE):
        self.size = size
        self._held: collections.deque = collections.deque()
        self._calls = _jdp_calls[0]

    def handed(self, tree: Any, count: bool) -> None:
        """A batch goes to the program: record the step and wait for the step `size` back.

        Args:
            tree: the batch (global arrays).
            count: count it as a training step (the Loader) or only as step-phase progress
                (`jdp.shard`, called once per field of a batch).
        """
        calls, self._calls = self._calls, _jdp_calls[0]
        if calls != self._calls:   # jdp's own steps consume these batches
            self._held.clear()
            return
        if count:
            _steps[0] += 1
        _progress.record("step", _steps[0] if count else None)
        self._held.append(jax.tree.leaves(tree))
        while len(self._held) > self.size:
            _wait_for_readers(self._held.popleft())


def _wait_for_readers(leaves: list) -> None:
    """Donate the arrays nobody else holds; the donation waits for the steps that read them."""
    free = [x for x in leaves if isinstance(x, jax.Array) and not x.is_deleted()
            and sys.getrefcount(x) <= 3]   # the list, the comprehension's name, the call
    del leaves
    if not free:
        return
    with warnings.catch_warnings():  # a platform without donation: nothing waits, no noise
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        jax.block_until_ready(_release(free))
