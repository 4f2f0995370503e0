"""The loss and the state agree on `rng`: checked once per trace, with the fix in the error.

A state with an `rng` (`TrainState.create(..., seed=)`) hands the loss `rng=` (a key per device
and step); a loss that declares `rng` needs a state that has one. Either slip would otherwise
surface as Python's bare "missing 1 required positional argument: 'rng'" or "got an
unexpected keyword argument 'rng'", which names neither `seed=` nor the loss's signature.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable


def check_loss_rng(loss_fn: Callable, has_rng: bool) -> None:
    """Raise TypeError when `loss_fn` and the state disagree on `rng`."""
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):   # no signature to read (some builtins): let the call say
        return
    rng = params.get("rng")
    takes = rng is not None or any(p.kind is p.VAR_KEYWORD for p in params.values())
    name = getattr(loss_fn, "__name__", repr(loss_fn))
    if has_rng and not takes:
        raise TypeError(
            f"jdp.train_step: the state has an rng (TrainState.create(..., seed=...)), so the "
            f"loss is called with rng= (a key per device and step), but {name}"
            f"{inspect.signature(loss_fn)} takes no rng: add an `rng` parameter to the loss, "
            "or create the state without seed= if the loss needs no randomness")
    if not has_rng and rng is not None and rng.default is rng.empty:
        raise TypeError(
            f"jdp.train_step: {name}{inspect.signature(loss_fn)} takes rng, but the state "
            "has no rng to derive it from: create the state with "
            "jdp.TrainState.create(..., seed=0) (the loss then gets a key per device and step "
            "as rng=), or give the loss's rng a default")
