"""FSDP's layers: a model whose layers are unrolled gathers one layer's parameters at a time.

Under `shard_params` the parameters enter the step split (`_grads.mapped_grads`) and the
compiler gathers each where it is used. In a scanned model that is inside the loop, one layer
at a time; in an unrolled model nothing ties a layer's gather to the layer, and XLA schedules
every gather at the start of the step (and again every re-gather of the backward pass), so
the whole model is live at once. Here each layer (a flax linen submodule found by a policy, an
NNX submodule, or a function marked with `layer`) runs as one `jax.custom_vjp`:

- forward, one layer ahead: the layer's split parameters are made to wait for the input of
  the layer before it and for the gather of the layer before, then gathered: the gather may
  run while the layer before computes, and no earlier, so at most two layers are whole at
  once; only the split parameters and the input are saved for the backward pass;
- backward, one layer ahead too: the parameters are gathered again once the layer after has
  its output cotangent (the last layer: once its own has arrived), so the gather may run
  while the layer after computes its backward pass; the layer's gradient is reduced over the
  devices and split again at once, and the cotangent of the input of the layer before waits
  for that reduced gradient (that layer's backward pass may run while this reduction does,
  the one before it waits for it, so the compiler cannot merge the reductions into one at
  the end of the step), as does the cotangent of a token the layer before handed this one
  (its reduction waits for this one's: no two are combined).

"Waits for" is stated in one of two forms (`_Gathering.barrier`). Where the compiler keeps
`lax.optimization_barrier` while it schedules (XLA:GPU removes barriers only after
scheduling; TPU gets the same form, unchecked), by a barrier: no arithmetic and no
collective. XLA:CPU removes barriers before it
schedules (`DROPS_BARRIERS`), so there it is data: an exact zero drawn from what is waited
for, folded in; a zero drawn from per-device values costs one all-reduce of a scalar (so that
it is the same on every device, as the parameters are) per layer and direction. The first
layer (or one whose predecessor ran in another trace, e.g. each under its own
`jax.checkpoint`) waits for its own input.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import get_opaque_trace_state  # jax.extend: JAX's API for libraries

from jdp.job import values
from jdp.spmd import mesh as _mesh
from jdp.spmd import storage as _storage


class _Gathering(NamedTuple):
    """What a layer needs to gather inside the step's device map: the vmap axes its parameters
    are unbatched over (the devices that hold one copy), the HSDP group (None: all), the
    ids of the parameter values the loss was given and those values (`is_given`), and whether
    the order of the gathers and reductions is stated with `lax.optimization_barrier` (else
    with data)."""
    axes: Any
    group: int | None
    ids: frozenset = frozenset()
    barrier: bool = False
    given: Any = None
    memo: dict | None = None   # `is_given`'s descriptions of `given`'s subtrees, once a trace


# Platforms whose compiler removes `lax.optimization_barrier` before it schedules: XLA:CPU
# (its expander runs among the simplification passes; XLA:GPU's runs after scheduling; TPU's
# is not checked and gets the barrier form).
DROPS_BARRIERS = frozenset({"cpu"})


_ACTIVE: contextvars.ContextVar[_Gathering | None] = contextvars.ContextVar(
    "jdp_fsdp_gathering", default=None)
_INSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("jdp_fsdp_in_layer",
                                                               default=False)
# While a loss is traced with layers gathering: a cell holding the array inputs of the last
# layer that gathered, the zero its gather waited for (the next layer's gather waits for
# both: one layer ahead, in order), the trace they belong to, the token it handed on, and a
# flag the next layer sets (`_one_layer`'s `followed`).
_BEFORE: contextvars.ContextVar[list | None] = contextvars.ContextVar("jdp_fsdp_before",
                                                                      default=None)
# While a step is traced: False when the compiler places every gather (no layer gathers on its
# own), else a list that records each layer that does (`_placement`).
_BY_LAYER: contextvars.ContextVar[list | bool] = contextvars.ContextVar("jdp_fsdp_by_layer",
                                                                       default=True)


def layer(fn: Callable) -> Callable:
    """Mark `fn(params, *args)` as one layer of a model written as plain functions.

    Under `jdp.train_step(..., shard_params=...)` the layer's parameters (the `params`
    subtree it is given) are gathered just before it runs and again in the backward pass, and
    their gradient is reduced as soon as the layer's backward pass is done, so an unrolled
    model holds one layer whole at a time. Anywhere else (one device, replicated, ZeRO, an
    evaluation, a loss under `layer_policy(enabled=False)`) it is `fn` itself.

    Args:
      fn: a function of the layer's parameters and its inputs (arrays or pytrees of them).

    Returns:
      A function with `fn`'s signature.

    Example:
        >>> import jax.numpy as jnp
        >>> dense = layer(lambda p, x: jnp.tanh(x @ p["w"]))
        >>> def model(params, x):
        ...     for p in params["layers"]:
        ...         x = dense(p, x)
        ...     return x
        >>> model({"layers": [{"w": jnp.eye(2)}] * 3}, jnp.ones((1, 2))).shape
        (1, 2)
    """
    @functools.wraps(fn)
    def call(params, *args, **kwargs):
        gathering = _ACTIVE.get()
        if gathering is None or _INSIDE.get():
            return fn(params, *args, **kwargs)
        _check_layer_params(fn, params, args)
        return gathered_call(lambda p, a, k: fn(p, *a, **k), params, (args, kwargs), gathering)
    return call


def _check_layer_params(fn: Callable, params: Any, args: tuple) -> None:
    """`layer`'s contract, said in one line: its first argument is the layer's parameters,
    arrays (a later argument that is the step's parameters, where the first is not: the
    arguments swapped)."""
    name = getattr(fn, "__name__", "the layer")
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not isinstance(x, jax.Array):
            raise TypeError(
                f"jdp.layer({name}): parameter {jax.tree_util.keystr(path) or '<root>'} is a "
                f"{type(x).__name__}, not an array; a layer's first argument is its "
                "parameters (arrays), its inputs come after: call it as layer(params, x, ...)")
    if not is_given(params) and any(is_given(a) for a in args):
        raise ValueError(
            f"jdp.layer({name}): a later argument holds the parameters the loss was given, the "
            "first does not: the arguments are swapped; call it as layer(params, x, ...) with "
            "the layer's subtree of the step's params first")


_COLLECTIVES = frozenset({"psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute",
                          "psum_scatter", "reduce_scatter", "axis_index", "pbroadcast"})


def gathered_call(fn: Callable, params: Any, args: tuple, gathering: _Gathering) -> Any:
    """`fn(params, *args)` with `params` gathered just in time, forward and backward.

    A layer with a collective inside (a BatchNorm synced over the devices, `axis_name=`)
    cannot be recomputed in the backward pass, which runs outside the device map: it runs
    as it is, its parameters gathered where the compiler places them, and that is said once."""
    arrays, rebuild = _picked(args, lambda x: isinstance(x, (jax.Array, jax.core.Tracer)))
    pure, consts, collective = _hoisted(_inside(lambda p, a: fn(p, *rebuild(a))), params, arrays)
    if collective:
        say_once(gathered_call, "collective", "jdp: FSDP gathers a layer with a collective "
                 f"inside ({collective}, e.g. BatchNorm(axis_name=...)) where the compiler "
                 "places the gathers, not on its own: its backward pass cannot be recomputed "
                 "outside the device map; the numbers are the same")
        return fn(params, *args)
    recording = _BY_LAYER.get()
    if isinstance(recording, list):
        recording.append(getattr(fn, "__name__", "layer"))

    cell, trace = _BEFORE.get() or [None] * 5, _trace()
    if cell[2] == trace:   # one layer ahead: after the inputs of the layer before
        before, chain, token = cell[0], cell[1], cell[3]
        cell[4][0] = True   # that layer is followed: its backward gather waits for this one's
    else:   # the first layer, or the one before ran in another trace (`jax.checkpoint`)
        before, chain, token = arrays, None, None
    zero = None if gathering.barrier else _zero_after(before, gathering, chain)
    followed = [False]   # read when the backward pass is traced, after the whole forward
    out, token = _one_layer(pure, gathering, before, token is not None, followed)(
        params, arrays, consts, zero, before, token)
    cell[:] = arrays, zero, trace, token, followed
    return out


def _trace() -> Any:
    """The trace this layer is called in: values of another (a `jax.checkpoint` body's,
    closed since) cannot be used in it."""
    return get_opaque_trace_state(convention="jdp")


def _one_layer(pure: Callable, gathering: _Gathering, before: list, chained: bool,
               followed: list) -> Callable:
    """`run(params, arrays, consts, zero, before, token) -> (out, token)`: the layer `pure`,
    its parameters gathered once the arrays `before` (the inputs of the layer before) and
    `token` (handed on by the layer before) exist, or, in the data form, once `zero` (drawn
    from them; None in the barrier form) does. Backward, one layer ahead too: gathered again
    once the layer after (`followed[0]`) has its output's cotangent (else once this one's
    has arrived); its reduced gradient is waited for by `before`'s cotangents (the backward
    pass of the layer below the one before) and by the cotangent of `token` (`chained`: the
    layer before's reduction), so the compiler cannot combine two reductions; this layer's
    output cotangent, by the other half of that cotangent (the layer before's gather)."""
    like = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in before]

    @jax.custom_vjp
    def run(p, a, c, zero, before, token):
        full = _gather(p, gathering, (before, token) if gathering.barrier else zero)
        return pure(full, a, *c), (_handed_on(full, gathering), jnp.zeros((), jnp.float32))

    def fwd(p, a, c, zero, before, token):
        return run(p, a, c, zero, before, token), (p, a, c)

    def bwd(saved, cotangents):
        (p, a, c), (g, (after, ahead)) = saved, cotangents
        if not followed[0]:   # the last layer: its gather waits for its own output cotangent
            ahead = None if gathering.barrier else _zero_after(g, gathering)
        full = _gather(p, gathering, g if ahead is None else ahead)
        _, vjp = jax.vjp(lambda q, a, c: pure(q, a, *c), full, a, c)
        dp, da, dc = vjp(g)
        dp = jax.tree.map(lambda d: _reduced(d, gathering, after), dp)
        carried, handed_back = _after_reduced(like, jax.tree.leaves(dp), gathering)
        if not chained:
            return dp, da, dc, None, carried, None
        return dp, da, dc, None, carried, (handed_back, _ahead(g, full, ahead, followed[0],
                                                                gathering))

    run.defvjp(fwd, bwd)
    return run


def _reduced(d: jax.Array, gathering: _Gathering, after: jax.Array) -> jax.Array:
    """One parameter's gradient summed over the devices that share its copy, split again as
    stored (an integer parameter's zero cotangent stays as it is), once `after` (the token's
    cotangent: the next layer's reduction, an exact zero in the data form) exists."""
    if d.dtype == jax.dtypes.float0:
        return d
    d = lax.optimization_barrier((d, after))[0] if gathering.barrier else d + after.astype(
        d.dtype)
    return _split(lax.psum(d, gathering.axes), gathering)


def _hoisted(fn: Callable, *example: Any) -> tuple[Callable, list]:
    """`fn` as a function of `example`'s values and of every value it closes over (`consts`):
    `(pure, consts, collective)` with `pure(*example, *consts) == fn(*example)` and the first
    collective `fn` runs ('' when none). Unlike
    `jax.closure_convert`, every closed-over value is hoisted, random keys and integers too:
    the backward pass is traced after the device map, where a value of the map's trace that
    `fn` closed over could no longer be used."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*example)
    out_tree = jax.tree.structure(shape)
    n = len(jax.tree.leaves(example))

    def pure(*args):
        flat = jax.tree.leaves(args[:len(example)])
        out = jax.core.eval_jaxpr(closed.jaxpr, list(args[len(example):]), *flat[:n])
        return jax.tree.unflatten(out_tree, out)
    return pure, list(closed.consts), _collective(closed.jaxpr)


def _collective(jaxpr: Any) -> str:
    """The name of the first collective in `jaxpr` (its sub-jaxprs too), '' when none."""
    eqn = first_equation(jaxpr, lambda e: e.primitive.name in _COLLECTIVES)
    return eqn.primitive.name if eqn is not None else ""


def first_equation(jaxpr: Any, wanted: Callable[[Any], bool]) -> Any:
    """The first equation of `jaxpr` for which `wanted(eqn)`, looking into the sub-programs
    among its equations' parameters (cond's branches, scan's and remat's bodies, custom
    derivatives' programs) too; None when there is none."""
    for eqn in jaxpr.eqns:
        if wanted(eqn):
            return eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(inner, "jaxpr", inner)
                if hasattr(sub, "eqns") and (found := first_equation(sub, wanted)) is not None:
                    return found
    return None


def _inside(fn: Callable) -> Callable:
    """`fn` run with the layer flag set: a layer inside a layer is not gathered again."""
    def run(*args):
        token = _INSIDE.set(True)
        try:
            return fn(*args)
        finally:
            _INSIDE.reset(token)
    return run


def _picked(tree: Any, keep: Callable[[Any], bool]) -> tuple[list, Callable]:
    """The leaves of `tree` that `keep`, and a function that puts new values for them back
    among the rest (which stay what they are: Python values such as `deterministic=True`
    among a layer's arguments, integer or scalar parameters, which are not gathered)."""
    leaves, structure = jax.tree.flatten(tree)
    at = [i for i, x in enumerate(leaves) if keep(x)]

    def rebuild(picked):
        out = list(leaves)
        for i, x in zip(at, picked, strict=True):
            out[i] = x
        return jax.tree.unflatten(structure, out)
    return [leaves[i] for i in at], rebuild


def _gather(params: Any, gathering: _Gathering, after: Any) -> Any:
    """`params` whole on every device, gathered only once `after` exists: in the barrier
    form, anything to wait for; in the data form, an exact zero drawn from it (`_zero_after`;
    None: no wait)."""
    replicated = (_mesh.replicated() if gathering.group is None
                  else jax.sharding.NamedSharding(_mesh.group_mesh(gathering.group),
                                                  jax.sharding.PartitionSpec()))
    split, rebuild = _picked(params, lambda p: jnp.issubdtype(p.dtype, jnp.floating)
                             and p.ndim)
    if gathering.barrier:
        split = lax.optimization_barrier((split, after))[0]
    elif after is not None:
        split = [p + after.astype(p.dtype) for p in split]
    return rebuild([lax.with_sharding_constraint(_split(p, gathering), replicated)
                    for p in split])


def _ahead(g: Any, full: Any, ahead: Any, followed: bool, gathering: _Gathering) -> jax.Array:
    """What the backward gather of the layer before waits for: a float32 zero that exists
    once this layer's output cotangent `g` and its gathered parameters `full` do (barrier
    form: so that the two gathers are not combined), or drawn from `g` and from `ahead` (what
    this layer's gather waited for: data form, so that the all-reduces stay in order; for the
    last layer, that zero was drawn from `g` already)."""
    if gathering.barrier:
        return lax.optimization_barrier((jnp.zeros((), jnp.float32), g, full))[0]
    return _zero_after(g, gathering, ahead) if followed else ahead


def _handed_on(full: Any, gathering: _Gathering) -> jax.Array:
    """The token a layer hands the next one: a float32 zero that, in the barrier form, exists
    only once this layer's parameters are gathered (the next gather waits for it, so the
    compiler cannot combine the two)."""
    token = jnp.zeros((), jnp.float32)
    return lax.optimization_barrier((token, full))[0] if gathering.barrier else token


def _zero_after(after: Any, gathering: _Gathering,
                chain: jax.Array | None = None) -> jax.Array | None:
    """An exact float32 zero that the compiler can only compute once all of `after` exists:
    the sign bits of its leaves' first elements (0 or 1), the largest, over the devices too
    (so that it is the same on each, as the parameters are), times 0.0 — a finite number
    times zero, which XLA does not fold away (it cannot know the value is finite). `chain`,
    the previous layer's zero, joins the bits, so that the two all-reduces stay in order and
    the compiler cannot merge them into one that waits for the later layer's input."""
    leaves = [x for x in jax.tree.leaves(after) if hasattr(x, "dtype") and jnp.size(x)
              and jnp.issubdtype(x.dtype, jnp.number)]
    if chain is not None:
        leaves.append(chain)
    if not leaves:
        return None
    bits = functools.reduce(jnp.maximum, [_sign_bit(x) for x in leaves])
    return _sign_zero(lax.pmax(bits, gathering.axes))


def _sign_bit(x: jax.Array) -> jax.Array:
    first = jnp.ravel(x)[0]
    first = first.astype(jnp.float32) if first.dtype != jnp.float32 else first
    return lax.shift_right_logical(lax.bitcast_convert_type(first, jnp.uint32), jnp.uint32(31))


def _sign_zero(bit: jax.Array) -> jax.Array:
    return bit.astype(jnp.float32) * 0.0


def _after_reduced(like: list, reduced: list, gathering: _Gathering) -> tuple[list, Any]:
    """The cotangents that wait for a layer's `reduced` gradient: one for each input of the
    layer before (`like`: their shapes and dtypes; None, no cotangent, for one not floating)
    and one for the token the layer before handed on, all exact zeros (None when nothing is
    floating), through a barrier or drawn from the gradient (`_reduced_zero`)."""
    floats = [d for d in reduced if d.dtype != jax.dtypes.float0 and d.size
              and jnp.issubdtype(d.dtype, jnp.floating)]
    if gathering.barrier and floats:
        zero = lax.optimization_barrier((jnp.zeros((), jnp.float32), floats))[0]
    else:
        zero = _reduced_zero(floats)
    return _carried(like, zero), zero


def _reduced_zero(reduced: list) -> jax.Array | None:
    """An exact float32 zero drawn from every floating reduced gradient (its maximum, read
    from the split result): None when there is none."""
    return sum(_sign_zero(_sign_bit(jnp.max(d))) for d in reduced) if reduced else None


def _carried(like: list, zero: jax.Array | None) -> list:
    """Cotangents for the inputs of the layer before (`like`: their shapes and dtypes): `zero`
    (`_after_reduced`) on each floating input, None (no cotangent) on the rest. The layer before
    that cannot start its backward pass until this layer's gradient is reduced, so at most two
    layers' whole gradients are live at once."""
    def one(x):
        if zero is None or not jnp.issubdtype(x.dtype, jnp.floating):
            return None
        return jnp.broadcast_to(zero.astype(x.dtype), x.shape)
    return [one(x) for x in like]


def _split(x: jax.Array, gathering: _Gathering) -> jax.Array:
    """`x` split as FSDP stores a parameter of its shape (`_storage.stored_sharding`)."""
    return lax.with_sharding_constraint(x, _storage.stored_sharding(x, gathering.group))


def by_layer() -> bool:
    """Do layers gather on their own in the step being traced (not: the compiler places every
    gather, `_placement`)?"""
    return _BY_LAYER.get() is not False


ANYWHERE = object()   # `is_given`'s path for a module whose place in the model is not known


def is_given(params: Any, path: Any = None) -> bool:
    """Are `params` some of the step's own parameters, as the loss was given them, or (a
    module at `path`, or `ANYWHERE`: an NNX module, whose place is not known) as a lifted
    transform that passes them through whole hands them to the module (`nn.remat`,
    `nnx.remat`, `nn.jit`: a given subtree at `path`, its keys, shapes and dtypes)? Not when
    they are slices of them inside a scanned model (`nn.scan`, `nnx.scan`: those gather per
    layer already) or values the loss computed from them (a cast)."""
    gathering = _ACTIVE.get()
    leaves = jax.tree.leaves(params)
    if gathering is None or not leaves:
        return False
    if all(id(x) in gathering.ids for x in leaves):
        return True
    if path is ANYWHERE:
        memo = gathering.memo if gathering.memo is not None else {}
        if "subtrees" not in memo:
            memo["subtrees"] = {_described(t) for t in _subtrees(gathering.given)}
        return _described(params) in memo["subtrees"]
    return path is not None and _passed_through(params, gathering.given, path)


def _passed_through(params: Any, given: Any, path: tuple) -> bool:
    """Is `params` shaped as `given`'s subtree at `path` (keys, shapes, dtypes)?"""
    for key in path:
        if not hasattr(given, "keys") or key not in given:
            return False
        given = given[key]
    return _described(params) == _described(given)


def _described(tree: Any) -> tuple:
    """`tree`'s leaves as (key path, shape, dtype), sorted."""
    return tuple(sorted((jax.tree_util.keystr(k), jnp.shape(x), jnp.result_type(x))
                        for k, x in jax.tree_util.tree_leaves_with_path(tree)))


def _subtrees(tree: Any) -> list:
    """Every subtree of `tree` reached through its mappings (`tree` itself first)."""
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        found.append(node)
        if hasattr(node, "keys"):
            stack.extend(node[k] for k in node.keys())
    return found


@contextlib.contextmanager
def gathering(axes: Any, group: int | None, params: Any = None):
    """While the step traces the loss on `params`: `layer`s (and the layers a policy finds)
    gather."""
    ids = frozenset(id(x) for x in jax.tree.leaves(params))
    barrier = _mesh.mesh().devices.flat[0].platform not in DROPS_BARRIERS
    token = _ACTIVE.set(_Gathering(axes, group, ids, barrier, params, {}) if by_layer()
                        else None)
    before = _BEFORE.set([None] * 5)
    try:
        yield
    finally:
        _BEFORE.reset(before)
        _ACTIVE.reset(token)


class Policy(NamedTuple):
    """Which submodules of a flax model are its layers under FSDP (`layer_policy`)."""
    modules: tuple[type, ...] | None = None
    min_params: int | None = None
    enabled: bool = True


_POLICY = "_jdp_layer_policy"


def layer_policy(loss_fn: Callable, *, modules: Any = None, min_params: int | None = None,
                 enabled: bool = True) -> Callable:
    """`loss_fn` with the rule FSDP uses to find the layers of its flax model, in place of the
    default (the repeated submodules nearest the top: the blocks of a Python loop).

    Under `shard_params` each layer found is gathered on its own, just before it runs and
    again in the backward pass; what no layer holds is gathered where the compiler puts it.

    Args:
      loss_fn: the loss given to `jdp.train_step`.
      modules: a module class or a tuple of them: every outermost submodule of one of these
        classes is a layer (as FSDP2's `ModuleWrapPolicy`).
      min_params: every submodule holding at least this many parameters not already in a
        smaller layer is a layer, found from the innermost out (as FSDP2's size-based policy).
      enabled: False: no layer is gathered on its own, those marked with `layer` neither
        (the compiler places every gather).

    Returns:
      `loss_fn`, to give to `jdp.train_step`.

    Example:
        >>> loss = layer_policy(lambda params, batch: 0.0, min_params=1_000_000)
    """
    who = "jdp.layer_policy"
    modules = (modules,) if isinstance(modules, type) else modules
    what = "a module class or a tuple of them"
    if modules is not None and not isinstance(modules, tuple):
        raise values.wrong_type(who, "modules", modules, what, "e.g. modules=nn.Dense")
    if modules is not None and not (modules and all(isinstance(m, type) for m in modules)):
        raise values.wrong_value(who, "modules", modules, what, "e.g. modules=nn.Dense")
    if min_params is not None:
        min_params = values.integer(who, "min_params", min_params, minimum=1,
                                    fix="a parameter count")
    enabled = values.flag(who, "enabled", enabled, fix="False gathers no layer on its own")
    if modules is not None and min_params is not None:
        raise ValueError(f"{who}: give modules= or min_params=, not both")

    @functools.wraps(loss_fn)
    def loss(*args, **kwargs):
        return loss_fn(*args, **kwargs)
    setattr(loss, _POLICY, Policy(modules, min_params, enabled))
    return loss


_SAID: set = set()   # (id of a loss function, what): said once per loss function


def say_once(loss_fn: Callable, what: str, text: str) -> None:
    """Warn `text` once per loss function and kind of news (the step traces it again for
    each new input signature)."""
    key = (id(loss_fn), what)
    if key not in _SAID:
        _SAID.add(key)
        warnings.warn(text, UserWarning, stacklevel=2)


def policy_of(loss_fn: Callable) -> Policy:
    """The layer policy `loss_fn` carries (`layer_policy`), else the default."""
    return getattr(loss_fn, _POLICY, Policy())


def choose(found: dict, policy: Policy) -> frozenset:
    """The paths of the layers among `found` ({module path: (class, parameter count)}, the
    submodules holding parameters that the model called) under `policy`."""
    if not policy.enabled:
        return frozenset()
    if policy.min_params is not None:
        return _by_size(found, policy.min_params)
    if policy.modules is not None:
        picked = {p for p, (cls, _) in found.items() if p and issubclass(cls, policy.modules)}
        return frozenset(p for p in picked if not any(p[:i] in picked for i in range(len(p))))
    return _repeated(found)


def _repeated(found: dict) -> frozenset:
    """The default: the submodules of a class that occurs twice or more at one depth, at the
    smallest depth where one does (a Transformer's blocks, an MLP's layers)."""
    groups: dict = {}
    for path, (cls, _) in found.items():
        if path:
            groups.setdefault((cls, len(path)), []).append(path)
    repeated = [(depth, paths) for (_, depth), paths in groups.items() if len(paths) >= 2]
    if not repeated:
        return frozenset()
    top = min(depth for depth, _ in repeated)
    return frozenset(p for depth, paths in repeated if depth == top for p in paths)


def _by_size(found: dict, least: int) -> frozenset:
    """Innermost first: a submodule is a layer when the parameters it holds outside the layers
    already chosen inside it number at least `least` (the root is never one)."""
    chosen: set = set()
    for path in sorted(found, key=len, reverse=True):
        below = [c for c in chosen if c[:len(path)] == path]
        outer = [c for c in below if not any(c[:i] in chosen for i in range(len(path) + 1,
                                                                               len(c)))]
        if path and found[path][1] - sum(found[c][1] for c in outer) >= least:
            chosen.add(path)
    return frozenset(chosen)
