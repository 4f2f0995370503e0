"""Semi-synchronous replica groups: what the groups exchange at a sync, and the outer step.

With `Replicas(..., sync_every=H)` each group trains on its own for H steps (ordinary jdp
steps in its own layout, its optimizer state its own), then the groups in the quorum sync:

- LocalSGD (`outer=None`): the parameters averaged over the groups.
- DiLoCo (`outer=` an optax optimizer, e.g. `optax.sgd(0.7, momentum=0.9, nesterov=True)`):
  each group keeps the anchor (the parameters of the last sync); the pseudo-gradient
  `anchor - params` is averaged over the groups, the outer optimizer applies it to the anchor,
  and every group goes on from the new anchor. `optax.sgd(1.0)` gives LocalSGD's parameters.

The model state (BatchNorm statistics) is averaged at each sync in both. The carry (anchor and
outer optimizer state) travels with a heal.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jdp.core import model_state_field


@dataclasses.dataclass(frozen=True)
class Outer:
    """How a semi-synchronous group syncs: every `sync_every` steps, by `tx` (None: LocalSGD)."""
    sync_every: int
    tx: Any = None

    def describe(self) -> str:
        """What the groups compare at join (a different H or outer optimizer is named)."""
        how = "LocalSGD" if self.tx is None else "DiLoCo"
        return f"{how}, sync_every={self.sync_every}"

    def start(self, state: Any) -> tuple:
        """The carry at a sync point: `(anchor, outer_state)` for DiLoCo, `()` for LocalSGD."""
        if self.tx is None:
            return ()
        return _started(self.tx, state.params)

    def exchanged(self, state: Any, carry: tuple) -> tuple:
        """What each group adds at a sync: its parameters (LocalSGD) or its pseudo-gradient
        (DiLoCo), and its model state."""
        field = model_state_field(state)
        model_state = getattr(state, field) if field else None
        if self.tx is None:
            return state.params, model_state
        return _pseudo_gradient(carry[0], state.params), model_state

    def apply(self, state: Any, mean: tuple, carry: tuple) -> tuple:
        """`(state, carry)` after the sync, from the groups' mean of `exchanged`."""
        field = model_state_field(state)
        if self.tx is None:
            params = mean[0]
        else:
            params, anchor, outer_state = _outer_step(self.tx, mean[0], *carry)
            carry = (anchor, outer_state)
        state = state.replace(params=params, **({field: mean[1]} if field else {}))
        return state, carry


@jax.jit
def _pseudo_gradient(anchor: Any, params: Any) -> Any:
    return jax.tree.map(jnp.subtract, anchor, params)


def _started_fn(tx, params):
    anchor = jax.tree.map(jnp.copy, params)   # its own buffers: a donating step keeps it
    return anchor, tx.init(anchor)


_started = jax.jit(_started_fn, static_argnums=0)


def _outer_step_fn(tx, pseudo_gradient, anchor, outer_state):
    updates, outer_state = tx.update(pseudo_gradient, outer_state, anchor)
    anchor = optax.apply_updates(anchor, updates)
    params = jax.tree.map(jnp.copy, anchor)
    return params, anchor, outer_state


_outer_step = jax.jit(_outer_step_fn, static_argnums=0)
