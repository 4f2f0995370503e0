"""The layers of flax models under FSDP, found and gathered with no change to the model.

While the step traces the loss, a first, abstract pass (`jax.eval_shape`) records the
submodules that hold parameters and the policy (`_layers.choose`) picks the layers among them;
in the real pass each layer's call runs through `_layers.gathered_call` as a pure function of
its parameters.

- linen: `flax.linen.intercept_methods` sees every submodule's `__call__`; a layer is known by
  its module path, and runs as the module applied on its own, its other collections as they
  are.
- NNX has no method interceptor, so the `__call__` of every NNX module class is wrapped while
  a trace needs it (and restored after); a wrapped call reports only to the trace of its own
  context (a `contextvars.ContextVar`), so another thread's NNX calls run as written. A call
  is known by its place in the call tree (a path of call indices; the model's own call is
  `()`), and a layer runs on its `nnx.Param`s through
  `nnx.split` / `nnx.merge`, its other state (BatchNorm statistics, random counters) going in
  and coming back out as it would unwrapped.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jdp.spmd import layers as _layers


def find(loss_fn: Callable, trace: Callable[[], Any]) -> tuple[frozenset, frozenset]:
    """The layers (linen module paths, NNX call paths) of the flax model(s) that `trace()`
    calls, under `loss_fn`'s policy (`_layers.layer_policy`): `trace` runs abstractly once.

    A linen submodule that calls a module outside itself (a module shared by several blocks,
    tied weights) cannot run on its own parameters alone: it is left to the compiler, and a
    warning says so once. A policy of the user's that matches no submodule says so once."""
    policy = _layers.policy_of(loss_fn)
    linen, nnx = "flax.linen" in sys.modules, "flax.nnx" in sys.modules
    if not policy.enabled or not _layers.by_layer() or not (linen or nnx):
        return frozenset(), frozenset()
    found_linen: dict = {}
    found_nnx: dict = {}
    borrowing: dict = {}
    with contextlib.ExitStack() as stack:
        if linen:
            stack.enter_context(_linen_recording(found_linen, borrowing))
        if nnx:
            stack.enter_context(_nnx_recording(found_nnx))
        jax.eval_shape(trace)
    chosen = (_layers.choose(_own(found_linen, borrowing, loss_fn), policy),
              _layers.choose(found_nnx, policy))
    if not any(chosen) and (policy.modules or policy.min_params):
        _layers.say_once(loss_fn, "matched", f"jdp.layer_policy({_rule(policy)}) matched no "
                         "submodule of the model, which gathers as the compiler places it; "
                         "its submodules with parameters are of the classes "
                         f"{_classes(found_linen, found_nnx)}")
    return chosen


def _own(found: dict, borrowing: dict, loss_fn: Callable) -> dict:
    """`found` without the submodules that call a module outside themselves (`borrowing`:
    {path: the outside module's path}), which cannot be applied on their own."""
    if not borrowing:
        return found
    path, outside = next(iter(borrowing.items()))
    cls = found.get(path, (type(None), 0))[0].__name__
    _layers.say_once(loss_fn, "shared", f"jdp: FSDP gathers the {len(borrowing)} submodule(s) "
                     f"that call a module outside themselves (e.g. {cls} at "
                     f"{'/'.join(path)} calls {'/'.join(outside)}: a shared module or tied "
                     "weights) where the compiler places the gathers, not one layer at a "
                     "time; the model trains as it does replicated")
    return {p: v for p, v in found.items() if p not in borrowing}


def _rule(policy: Any) -> str:
    if policy.modules:
        return "modules=" + ", ".join(m.__name__ for m in policy.modules)
    return f"min_params={policy.min_params}"


def _classes(*found: dict) -> str:
    names = sorted({cls.__name__ for f in found for cls, _ in f.values()})
    return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "(none)"


@contextlib.contextmanager
def gathering(found: tuple[frozenset, frozenset]):
    """While the loss is traced: the layers `find` found gather their parameters on their
    own."""
    with contextlib.ExitStack() as stack:
        if found[0]:
            stack.enter_context(_linen_gathering(found[0]))
        if found[1]:
            stack.enter_context(_nnx_gathering(found[1]))
        yield


@contextlib.contextmanager
def _linen_recording(found: dict, borrowing: dict):
    """Records {module path: (class, parameter count)} of the linen submodules called, and
    in `borrowing` {path: outside path} those that call a module with parameters outside
    their own subtree."""
    import flax.linen as nn
    running: list = []   # the paths of the submodule calls under way, outermost first

    def record(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or module.scope is None:
            return next_fun(*args, **kwargs)
        path = tuple(module.path)
        params = module.variables.get("params", {})
        count = sum(int(np.size(x)) for x in jax.tree.leaves(params))
        if count and _layers.is_given(params, path):
            found[path] = (type(module), count)
            for outer in running:
                if path[:len(outer)] != outer:
                    borrowing.setdefault(outer, path)
        running.append(path)
        try:
            return next_fun(*args, **kwargs)
        finally:
            running.pop()

    with nn.intercept_methods(record):
        yield


@contextlib.contextmanager
def _linen_gathering(paths: frozenset):
    """The linen submodules at `paths` gather their parameters on their own."""
    import flax.linen as nn

    def gather(next_fun, args, kwargs, context):
        gathering, module = _layers._ACTIVE.get(), context.module
        if (gathering is None or _layers._INSIDE.get() or context.method_name != "__call__"
                or module.scope is None or module.path not in paths):
            return next_fun(*args, **kwargs)
        out = _linen_call(module, args, kwargs, gathering)
        return next_fun(*args, **kwargs) if out is _AS_IS else out

    with nn.intercept_methods(gather):
        yield


_AS_IS = object()


def _linen_call(module: Any, args: tuple, kwargs: dict, gathering: Any) -> Any:
    """`module(*args, **kwargs)` with its parameters gathered on their own (`_AS_IS` while
    the model initialises).

    The model may be applied with collections it writes (`mutable=["batch_stats"]`: BatchNorm
    statistics in training, sown values): the layer applied on its own gets the same filter
    (flax's `Scope.mutable`), and what it wrote comes back out and is written into the
    model's scope, where the model's own `apply` returns it."""
    if module.is_initializing():
        return _AS_IS
    variables = dict(module.variables)
    params = variables.pop("params")
    mutable = getattr(module.scope, "mutable", False)
    # The module's own random streams (flax's `Scope.rngs`: the key and the path folded into
    # it lazily), so that the layer applied on its own draws what it draws in place; flax's
    # public `apply` takes only keys, so the layer is bound to a root `Scope` made with them,
    # as `Module.apply` binds a model (`clone(parent=scope, _deep_clone=True)`).
    from flax.core import Scope

    rngs = dict(getattr(module.scope, "rngs", {}))

    def apply(p, call_args, held):
        a, k = call_args
        scope = Scope({"params": p, **held}, rngs=rngs, mutable=mutable)
        out = module.clone(parent=scope, _deep_clone=True)(*a, **k)
        written = scope.mutable_variables() if mutable is not False else {}
        return out, {c: v for c, v in written.items() if c != "params"}
    out, written = _layers.gathered_call(apply, params, ((args, kwargs), variables), gathering)
    for collection, tree in written.items():
        _put(module.scope, collection, tree)
    return out


def _put(scope: Any, collection: str, tree: Any) -> None:
    """Write `tree` (a collection's variables of the module at `scope`, its submodules' as
    nested dicts, as flax keeps them) into `scope`, as the layer's writes in place would."""
    for name, value in tree.items():
        scope.put_variable(collection, name, value)


class _Calls:
    """The call tree of one trace: the path of the call running now, and each path's count
    of calls made under it so far."""

    def __init__(self, on_call: Callable):
        self.path: tuple = ()
        self.counts: dict = {}
        self.depth = 0
        self.current: Any = None   # the module whose call runs now
        self.on_call = on_call


@contextlib.contextmanager
def _nnx_recording(found: dict):
    """Records {call path: (class, parameter count)} of the NNX modules called."""
    from flax import nnx

    def record(module, path, call, args, kwargs):
        params = nnx.state(module, nnx.Param)
        count = sum(int(np.size(x)) for x in jax.tree.leaves(params))
        if count and _layers.is_given(params, _layers.ANYWHERE):
            found[path] = (type(module), count)
        return call(module, *args, **kwargs)

    with _wrapped(_Calls(record)):
        yield


@contextlib.contextmanager
def _nnx_gathering(paths: frozenset):
    """The NNX modules called at `paths` gather their parameters on their own."""

    def gather(module, path, call, args, kwargs):
        gathering = _layers._ACTIVE.get()
        if gathering is None or path not in paths:
            return call(module, *args, **kwargs)
        return _nnx_call(module, call, args, kwargs, gathering)

    with _wrapped(_Calls(gather)):
        yield


_CALLS: contextvars.ContextVar[_Calls | None] = contextvars.ContextVar("jdp_nnx_calls",
                                                                       default=None)
_WRAPPED: dict = {"traces": 0, "own": []}   # traces under way, and the classes' own __call__s
_WRAPPING = threading.Lock()


@contextlib.contextmanager
def _wrapped(calls: _Calls):
    """The NNX calls of this context report to `calls` for the duration. NNX offers no
    interceptor: every NNX module class's own `__call__` is wrapped while any trace needs it
    (the classes are restored when the last one ends), and a wrapped call reports only to the
    trace of its own context."""
    token = _CALLS.set(calls)
    with _WRAPPING:
        if not _WRAPPED["traces"]:
            _WRAPPED["own"] = _own_calls()
            for cls, fn in _WRAPPED["own"]:
                cls.__call__ = _reporting(fn)
        _WRAPPED["traces"] += 1
    try:
        yield
    finally:
        _CALLS.reset(token)
        with _WRAPPING:
            _WRAPPED["traces"] -= 1
            if not _WRAPPED["traces"]:
                for cls, fn in _WRAPPED["own"]:
                    cls.__call__ = fn


def _own_calls() -> list:
    """(class, its own `__call__`) of every NNX module class defined now."""
    from flax import nnx

    classes, seen = [nnx.Module], set()
    while classes:
        cls = classes.pop()
        if cls not in seen:
            seen.add(cls)
            classes.extend(cls.__subclasses__())
    return [(cls, cls.__dict__["__call__"]) for cls in seen if "__call__" in cls.__dict__]


def _reporting(fn: Callable) -> Callable:
    """`fn` (a module's `__call__`) reporting its call and place to the context's trace; the
    calls outside a trace, inside a layer, or inside a `super().__call__` are not reported."""
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        calls = _CALLS.get()
        if calls is None or _layers._INSIDE.get() or calls.current is self:
            return fn(self, *args, **kwargs)
        parent, path = calls.path, ()
        if calls.depth:
            path = parent + (calls.counts.get(parent, 0),)
            calls.counts[parent] = path[-1] + 1
        outer = calls.current
        calls.path, calls.current, calls.depth = path, self, calls.depth + 1
        try:
            return calls.on_call(self, path, fn, args, kwargs)
        finally:
            calls.path, calls.current, calls.depth = parent, outer, calls.depth - 1
    return call


def _nnx_call(module: Any, call: Callable, args: tuple, kwargs: dict, gathering: Any) -> Any:
    """`call(module, *args, **kwargs)` (the class's own `__call__`) with the module's
    `nnx.Param`s gathered on their own; its other state threaded through and written back.

    So are the graph nodes among the arguments (an `nnx.Rngs` passed at the call, as in
    `block(x, rngs=rngs)`): the layer runs on copies of them, and what it changed in them
    (a random stream's count) is written back, so the next layer draws the next numbers, as
    it would unwrapped; the backward pass recomputes the layer from the counts it began with,
    so it draws the forward pass's numbers again."""
    from flax import nnx

    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    nodes = _graph_nodes((args, kwargs))

    def pure(p, call_args, state):
        inner = nnx.merge(graphdef, p, state)
        out = call(inner, *call_args[0], **call_args[1])
        changed = [nnx.state(node) for node in _graph_nodes(call_args)]
        return out, nnx.state(inner, nnx.Not(nnx.Param)), changed

    out, new_rest, changed = _layers.gathered_call(pure, params, ((args, kwargs), rest), gathering)
    nnx.update(module, new_rest)
    for node, state in zip(nodes, changed, strict=True):
        nnx.update(node, state)
    return out


def _graph_nodes(tree: Any) -> list:
    """The NNX graph nodes (`nnx.Rngs`, modules) in `tree`, in order."""
    from flax import nnx

    is_node = nnx.graph.is_graph_node
    return [x for x in jax.tree.leaves(tree, is_leaf=is_node) if is_node(x)]
