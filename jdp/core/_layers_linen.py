"""The layers of a flax linen model under FSDP, found and gathered with no change to the model.

While the step traces the loss, `flax.linen.intercept_methods` sees every submodule's
`__call__`. A first, abstract pass (`jax.eval_shape`) records the submodules that hold
parameters; the policy (`_layers.choose`) picks the layers among them; in the real pass each
layer's call runs through `_layers.gathered_call` as a pure function of its parameters (the
module applied on its own, with its other collections as they are).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable

import jax
import numpy as np

from jdp.core import _layers


def in_use() -> bool:
    """Has the program imported flax linen (else no model of it can be in the loss)?"""
    return "flax.linen" in sys.modules


def find(policy: _layers.Policy, trace: Callable[[], Any]) -> frozenset:
    """The paths of the layers of the linen model(s) `trace()` calls, under `policy`: `trace`
    runs abstractly once, its submodules' calls recorded."""
    if not policy.enabled or not in_use():
        return frozenset()
    import flax.linen as nn

    found: dict = {}

    def record(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name == "__call__" and module.scope is not None:
            params = module.variables.get("params", {})
            count = sum(int(np.size(x)) for x in jax.tree.leaves(params))
            if count:
                found[module.path] = (type(module), count)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(trace)
    return _layers.choose(found, policy)


@contextlib.contextmanager
def gathering(paths: frozenset):
    """While the loss is traced: the linen submodules at `paths` gather their parameters on
    their own (`_layers.gathered_call`)."""
    if not paths:
        yield
        return
    import flax.linen as nn

    def gather(next_fun, args, kwargs, context):
        where, module = _layers._ACTIVE.get(), context.module
        if (where is None or _layers._INSIDE.get() or context.method_name != "__call__"
                or module.scope is None or module.path not in paths):
            return next_fun(*args, **kwargs)
        out = _call(module, args, kwargs, where)
        return next_fun(*args, **kwargs) if out is _AS_IS else out

    with nn.intercept_methods(gather):
        yield


_AS_IS = object()


def _call(module: Any, args: tuple, kwargs: dict, where: Any) -> Any:
    """`module(*args, **kwargs)` with its parameters gathered on their own; `_AS_IS` for a module
    that writes a collection in this call (BatchNorm statistics, sown values): those run as
    they are, gathered where the compiler puts them."""
    variables = dict(module.variables)
    params = variables.pop("params")
    if any(module.is_mutable_collection(c) for c in variables) or _writes(module):
        return _AS_IS
    # The scope's random streams by name: flax has no public list of them (`Scope.rngs`).
    names = list(getattr(module.scope, "rngs", {}))
    rngs = {name: module.make_rng(name) for name in names} or None
    alone = module.clone(parent=None)

    def apply(p, call_args):
        a, k = call_args
        return alone.apply({"params": p, **variables}, *a, rngs=rngs, **k)
    return _layers.gathered_call(apply, params, ((args, kwargs),), where)


def _writes(module: Any) -> bool:
    """Could `module`'s call create or write variables (initialisation, a mutable
    collection that holds nothing yet)?"""
    return module.is_initializing()
