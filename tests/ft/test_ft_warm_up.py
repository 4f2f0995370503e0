"""A group compiles its step before it makes itself known to the Lighthouse
(`Replicas._warm_up`, then `_connect`): from the moment its torchft manager starts heartbeating,
through its first quorum to the end of its first attempt, the step's two halves and the
exchange's buffers run without one XLA compilation, so a group that joins a running job keeps
nobody waiting, neither in a quorum (the Lighthouse waits for a heartbeating group) nor in the
all-reduce. Real jitted halves, JAX's own compile events counted."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp.ft import _buffers, _replicas

torch = pytest.importorskip("torch")   # the exchange's host buffers are torch tensors

COMPILED = "/jax/core/compile/backend_compile_duration"
EVENTS: list = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, seconds, **kw: EVENTS.append(name) if name == COMPILED else None)


def _halves():
    def gradients(state, batch):
        loss = lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2)   # noqa: E731
        return jax.grad(loss)(state["w"]), {}, {"loss": loss(state["w"])}
    update = jax.jit(lambda state, grads, model_state: {"w": state["w"] - 0.1 * grads},
                     donate_argnums=(0,))
    return jax.jit(gradients), update


def _group(loader, halves):
    """A Replicas with its step (a TrainStep's halves, averaged) and loader, its connection to
    torchft and its quorum recorded (as the compilations done by then), nothing of torchft."""
    group = object.__new__(_replicas.Replicas)
    connects, quorums = [], []

    def connect(*timeouts):
        connects.append(len(EVENTS))
        return SimpleNamespace(current_step=lambda: 0), None, None
    group.__dict__.update(
        _train=None if halves is None else SimpleNamespace(
            gradients=halves[0], update=halves[1], options=SimpleNamespace(mean=True)),
        _outer=None, _batch=None, _epochs=None, loader=loader,
        _fields={}, _ready=False, _state={"w": jnp.zeros((4,))}, _manager=None, _events=None,
        _plans={},
        _timeouts=(1.0, 1.0), _torchft=connect, _quorum=lambda: quorums.append(len(EVENTS)))
    return group, connects, quorums


@pytest.mark.parametrize("warm", [True, False])
def test_nothing_compiles_once_the_group_heartbeats_to_the_lighthouse(warm):
    rng = np.random.default_rng(0)
    loader = [{"x": rng.normal(size=(8, 4)).astype(np.float32), "y": np.float32(i + 1)}
              for i in range(3)]
    gradients, update = _halves()
    group, connects, quorums = _group(loader, (gradients, update) if warm else None)
    batches = group.batches(2)
    batch = next(batches)
    assert batch is loader[0] and len(connects) == len(quorums) == 1   # after one quorum
    tree = gradients(group._state, batch)   # the attempt, as `_attempt` runs it
    plan = _buffers.Buffers.of(tree, _replicas._divided(tree, True), group._plans)
    buffers = plan.flatten(tree)
    host = _buffers.to_host(buffers)   # one group: the all-reduce leaves them as they are
    grads, model_state, _ = plan.unflatten(_buffers.back(buffers, host), tree, 1)
    state = update(group._state, grads, model_state)
    compiled_after_connect = len(EVENTS) - connects[0]
    assert (compiled_after_connect == 0) == warm, compiled_after_connect
    x = loader[0]["x"].astype(np.float64)   # the gradient of the mean squared error at w = 0
    want = -0.1 * 2 * x.T @ (x @ np.zeros(4) - 1.0) / 8
    np.testing.assert_allclose(state["w"], want, atol=1e-6)   # the step's numbers unchanged
    batches.close()
