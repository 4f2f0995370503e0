"""Semi-synchronous replica groups: what the groups exchange at a sync, and the outer step.

With `Replicas(..., sync_every=H)` each group trains on its own for H steps (ordinary jdp
steps in its own layout, its optimizer state its own), then the groups in the quorum sync:

- LocalSGD (`outer=None`): the parameters averaged over the groups.
- DiLoCo (`outer=` an optax optimizer, e.g. `optax.sgd(0.7, momentum=0.9, nesterov=True)`):
  each group keeps the anchor (the parameters of the last sync); the pseudo-gradient
  `anchor - params` is averaged over the groups, the outer optimizer applies it to the anchor,
  and every group goes on from the new anchor. `optax.sgd(1.0)` gives LocalSGD's parameters.
- Streaming (`fragments=F`, `overlap=tau`): the parameters' leaves in F contiguous fragments
  of about equal size, fragment f synced after steps (f + 1) H / F, H + (f + 1) H / F, ...
  (the last of these left out when the run ends within H steps after it: the run's final
  sync of every fragment takes its place, so a fragment syncs once per H steps at most);
  each sync's all-reduce runs while the group takes `tau` more steps, and its result is
  merged then: the fragment becomes the sync's result plus the group's own change since it
  sent (no step is lost; tau = 0 is the plain result).

The model state (BatchNorm statistics) is averaged with the last fragment's syncs. The carry
(the anchor and each fragment's outer optimizer state) travels with a heal.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jdp.core import model_state_field


@dataclasses.dataclass(frozen=True)
class Outer:
    """How a semi-synchronous group syncs: every `sync_every` steps, by `tx` (None:
    LocalSGD), in `fragments` parts whose all-reduces overlap `overlap` steps."""
    sync_every: int
    tx: Any = None
    fragments: int = 1
    overlap: int = 0

    def describe(self) -> str:
        """What the groups compare at join (another mode or schedule is named)."""
        how = "LocalSGD" if self.tx is None else "DiLoCo"
        streaming = (f", fragments={self.fragments}, overlap={self.overlap}"
                     if self.fragments > 1 or self.overlap else "")
        return f"{how}, sync_every={self.sync_every}{streaming}"

    def due(self, steps: int, num_steps: int) -> int | None:
        """The fragment whose sync starts after the group's step `steps` of `num_steps`, or
        None. None too when the run ends before that fragment's next sync: the run's final
        sync, fewer than `sync_every` steps later, takes its place, so that each fragment
        syncs at most once per `sync_every` steps, the end included."""
        stride = self.sync_every // self.fragments
        if steps % stride or steps + self.sync_every > num_steps:
            return None
        return (steps // stride - 1) % self.fragments

    def parts(self, params: Any) -> tuple:
        """The fragments' leaf indices: contiguous runs of `params`' leaves (at least
        `fragments` of them), each run's end where the sizes so far come closest to an equal
        share. Computed once per model (every step of a sync asks)."""
        return _parts(tuple(math.prod(x.shape) for x in jax.tree.leaves(params)),
                      self.fragments)

    def start(self, state: Any) -> tuple:
        """The carry at a sync point: `(anchor, outer states per fragment)` for DiLoCo, `()`
        for LocalSGD."""
        if self.tx is None:
            return ()
        anchor = copied(state.params)
        leaves = jax.tree.leaves(anchor)
        return anchor, tuple(_init(self.tx, [leaves[i] for i in part])
                             for part in self.parts(anchor))

    def sent(self, state: Any, fragment: int) -> list:
        """Fragment `fragment` of the parameters, as sent (its leaves)."""
        leaves = jax.tree.leaves(state.params)
        return [leaves[i] for i in self.parts(state.params)[fragment]]

    def exchanged(self, state: Any, carry: tuple, fragment: int) -> tuple:
        """What each group adds at fragment `fragment`'s sync: its parameters (LocalSGD) or
        its pseudo-gradient (DiLoCo), and with the last fragment its model state."""
        field = model_state_field(state)
        last = fragment == self.fragments - 1
        model_state = getattr(state, field) if field and last else None
        mine = self.sent(state, fragment)
        if self.tx is None:
            return mine, model_state
        anchor = jax.tree.leaves(carry[0])
        part = self.parts(state.params)[fragment]
        return _pseudo_gradient([anchor[i] for i in part], mine), model_state

    def apply(self, state: Any, mean: tuple, carry: tuple, fragment: int,
              sent: list) -> tuple:
        """`(state, carry)` after fragment `fragment`'s sync, from the groups' mean of
        `exchanged`: the fragment is the sync's result plus this group's change since it
        sent `sent`."""
        part = self.parts(state.params)[fragment]
        leaves, treedef = jax.tree.flatten(state.params)
        if self.tx is None:
            result = mean[0]
        else:
            anchor, states = carry
            anchor_leaves, anchor_def = jax.tree.flatten(anchor)
            result, new_states = _outer_step(self.tx, mean[0], [anchor_leaves[i] for i in part],
                                             states[fragment])
            for i, value in zip(part, copied(result), strict=True):
                anchor_leaves[i] = value
            carry = (jax.tree.unflatten(anchor_def, anchor_leaves),
                     tuple(new_states if f == fragment else s for f, s in enumerate(states)))
        now = [leaves[i] for i in part]
        for i, value in zip(part, _merged(result, now, sent), strict=True):
            leaves[i] = value
        field = model_state_field(state)
        extra = {field: mean[1]} if field and mean[1] is not None else {}
        return state.replace(params=jax.tree.unflatten(treedef, leaves), **extra), carry


@jax.jit
def copied(tree: Any) -> Any:
    """`tree` in buffers of its own (a donating step leaves it whole: the anchor, and what
    a sync in flight sent)."""
    return jax.tree.map(jnp.copy, tree)


@jax.jit
def _pseudo_gradient(anchor: list, params: list) -> list:
    return [a - p for a, p in zip(anchor, params, strict=True)]


@jax.jit
def _merged(result: list, now: list, sent: list) -> list:
    return [r + (n - s) for r, n, s in zip(result, now, sent, strict=True)]


def _init(tx: Any, leaves: list) -> Any:
    """`tx.init(leaves)`, run eagerly so each moment lies as its parameter does; what does
    not follow a parameter (a step count) is placed whole on the parameters' mesh, so that a
    heal, which places the state as this one lies, keeps it on every device."""
    state = tx.init(leaves)
    mesh = next((x.sharding.mesh for x in leaves if isinstance(x.sharding, NamedSharding)), None)
    if mesh is None:
        return state
    whole = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: x if getattr(x, "committed", True) else
                        jax.device_put(x, whole), state)


def _outer_step_fn(tx, pseudo_gradient, anchor, outer_state):
    updates, outer_state = tx.update(pseudo_gradient, outer_state, anchor)
    return optax.apply_updates(anchor, updates), outer_state


_outer_step = jax.jit(_outer_step_fn, static_argnums=0)


@functools.lru_cache(maxsize=16)
def _parts(sizes: tuple, fragments: int) -> tuple:
    """`Outer.parts` of leaves of these `sizes`."""
    cumulative = [0, *itertools.accumulate(sizes)]
    n, bounds = len(sizes), [0]
    for k in range(1, fragments):
        share = cumulative[-1] * k / fragments
        ends = range(bounds[-1] + 1, n - (fragments - k) + 1)
        bounds.append(min(ends, key=lambda e, share=share: abs(cumulative[e] - share)))
    bounds.append(n)
    return tuple(tuple(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False))
