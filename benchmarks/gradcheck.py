"""Gradients of each CNN formulation against a float64 reference: a faster formulation must
not change results (PERF_NOTES: some XLA CPU formulations gave kernel gradients off by 1e-2).

The reference is the example's own formulation (flax `nn.BatchNorm`) run in float64 on the
same parameters and the same 64 examples, with BatchNorm statistics over those 64, as one device
(one DDP replica) computes them. It runs op by op, NOT under `jax.jit`: with JAX 0.10.2 on CPU
the jitted float64 gradient of this CNN (two conv-BatchNorm blocks) is wrong, its conv and
BatchNorm gradients 40-60 % off, while the op-by-op one agrees with float64 central finite
differences (checked here along a random direction) and with every float32 formulation to
~1e-6. Reported per formulation: the relative error of the whole
gradient, the worst relative error over the parameter arrays, and the errors of the loss and of
the updated BatchNorm statistics. The convolution biases are left out of the per-array worst
case: a bias right before BatchNorm has a gradient that is zero in exact arithmetic, so in float32
it is pure rounding noise relative to itself (it still counts in the whole-gradient error).

    python -m benchmarks.gradcheck      # prints one JSON line
"""
from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cnn


def _grads(state: Any, dtype: Any, batch: dict, jit: bool = True) -> tuple:
    """Loss, gradient and new BatchNorm statistics of one formulation at `dtype`."""
    params = jax.tree.map(lambda x: x.astype(dtype), state.params)
    stats = jax.tree.map(lambda x: x.astype(dtype), state.model_state)

    def loss(p):
        value, (_, new_stats) = cnn.example.loss_fn(p, batch, stats, state.apply_fn)
        return value, new_stats

    grad_fn = jax.value_and_grad(loss, has_aux=True)
    (value, new_stats), grads = (jax.jit(grad_fn) if jit else grad_fn)(params)
    return jax.tree.map(lambda x: np.asarray(x, np.float64), (value, grads, new_stats))


def _rel(a: Any, b: Any) -> float:
    """||a - b|| / ||b|| over all leaves of two trees."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    diff = sum(float(np.sum((x - y) ** 2)) for x, y in pairs)
    norm = sum(float(np.sum(y ** 2)) for y in jax.tree.leaves(b))
    return (diff / norm) ** 0.5 if norm else float("inf")


def _worst_leaf(grads: Any, ref: Any) -> tuple[float, str]:
    """Largest per-array relative error, skipping the convolution biases (see module doc)."""
    worst, where = 0.0, ""
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref),
                       strict=True):
        name = jax.tree_util.keystr(path)
        if "Conv" in name and "bias" in name:
            continue
        err = _rel(g, r)
        if err > worst:
            worst, where = err, name
    return worst, where


def _finite_difference(state: Any, batch: dict, grads: Any, eps: float = 1e-8) -> float:
    """Relative gap between <grads, d> and the float64 central difference of the loss along
    a random direction d (call inside `jax.enable_x64`). A small step: relu and max-pool
    kinks crossed by larger ones cost 1e-4..1e-2 of agreement (measured), not the gradient."""
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), state.params)
    stats = jax.tree.map(lambda x: np.asarray(x, np.float64), state.model_state)
    rng = np.random.default_rng(0)
    direction = jax.tree.map(lambda x: rng.standard_normal(x.shape), params)

    def loss(sign):
        p = jax.tree.map(lambda x, d: x + sign * eps * d, params, direction)
        return float(cnn.example.loss_fn(p, batch, stats, state.apply_fn)[0])

    numeric = (loss(1) - loss(-1)) / (2 * eps)
    analytic = sum(float(np.vdot(g, d)) for g, d in
                   zip(jax.tree.leaves(grads), jax.tree.leaves(direction), strict=True))
    return abs(numeric - analytic) / abs(analytic)


def _restrict(tree: Any, like: Any) -> Any:
    """The entries of nested dict `tree` that `like` has (a formulation without conv biases
    gets the reference's other parameters; its gradient is compared on those)."""
    if not isinstance(like, dict):
        return tree
    return {k: _restrict(tree[k], v) for k, v in like.items()}


def check(models=tuple(cnn.MODELS), per_device: int = 64) -> dict:
    """Errors of each formulation's float32 gradient against the float64 reference, all at
    the reference's parameter values."""
    batch = jax.device_put(cnn.host_batch(per_device, seed=1))
    # States are created outside the x64 context: initialisers draw other numbers inside it.
    states = {name: cnn.create_state(name) for name in {"example", *models}}
    ref_params = states["example"].params
    states = {name: st.replace(params=_restrict(ref_params, st.params))
              for name, st in states.items()}
    with jax.enable_x64(True):
        ref_loss, ref_grads, ref_stats = _grads(states["example"], jnp.float64, batch, jit=False)
        out = {"reference_vs_finite_difference": _finite_difference(states["example"], batch,
                                                                    ref_grads)}
    for name in models:
        loss, grads, stats = _grads(states[name], jnp.float32, batch)
        ref = _restrict(ref_grads, grads)
        worst, where = _worst_leaf(grads, ref)
        out[name] = {"grad_rel": _rel(grads, ref), "worst_array_rel": worst,
                     "worst_array": where, "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
                     "stats_rel": _rel(stats, ref_stats)}
    return out


if __name__ == "__main__":
    print(json.dumps(check()))
