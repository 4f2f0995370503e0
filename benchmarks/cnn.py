"""The benchmarked model and steps: the MNIST CNN of `examples/mnist.py`, jdp's and by hand.

Three ways to train the same CNN on the same batch with the same optimiser (SGD, momentum 0.9,
constant learning rate, as the PyTorch peer uses), with buffer donation everywhere:

* `jdp_step`: `jdp.train_step` over the example's own `CNN` and `loss_fn`, as the example
  builds it;
* `hand_step`: a hand-written `jax.pmap` step with `lax.pmean` on gradients, BatchNorm
  statistics and metrics (the same work jdp does), to measure what jdp's wrapper costs;
* `CNN(norm=ScaleShiftBatchNorm)`: the example's CNN with BatchNorm applied as one per-channel
  multiply-add (`x * m + a`) instead of flax's `(x - mean) * m + bias` (PERF_NOTES lead).

Parameter and statistics trees are the same in both formulations (same names and shapes), so a
checkpoint of one loads into the other.
"""
from __future__ import annotations

import collections
import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jdp
from jdp._mesh import local_sharding

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEARNING_RATE = 0.05
MOMENTUM = 0.9


def load_example() -> Any:
    """Import `examples/mnist.py` (not a package) as a module."""
    path = os.path.join(REPO, "examples", "mnist.py")
    spec = importlib.util.spec_from_file_location("jdp_examples_mnist", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = load_example()


class ScaleShiftBatchNorm(nn.Module):
    """Training-mode BatchNorm over all axes but the last, applied as `x * m + a` per channel.

    Same statistics (E[x^2] - E[x]^2, biased, as flax), same running-average update, same
    parameters ("scale", "bias") and statistics ("mean", "var") as `nn.BatchNorm`. Folding the
    normalisation into one multiplier and one offset per channel leaves XLA one elementwise
    pass over the activations forward and a cheaper backward.
    """

    use_running_average: bool = False
    momentum: float = 0.9
    epsilon: float = 1e-5

    @nn.compact
    def __call__(self, x):
        channels = (x.shape[-1],)
        scale = self.param("scale", nn.initializers.ones, channels, jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, channels, jnp.float32)
        ra_mean = self.variable("batch_stats", "mean", jnp.zeros, channels, jnp.float32)
        ra_var = self.variable("batch_stats", "var", jnp.ones, channels, jnp.float32)
        if self.use_running_average:
            mean, var = ra_mean.value, ra_var.value
        else:
            axes = tuple(range(x.ndim - 1))
            mean = x.mean(axes)
            var = jnp.maximum(0.0, (x * x).mean(axes) - mean * mean)
            if not self.is_initializing():
                ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean
                ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * var
        multiplier = scale * lax.rsqrt(var + self.epsilon)
        return x * multiplier + (bias - mean * multiplier)


class CNN(nn.Module):
    """The example's CNN with a choice of BatchNorm; module names match `example.CNN`.

    `conv_bias=False` drops the convolution biases, which BatchNorm's mean subtraction
    cancels exactly (their gradient is zero in exact arithmetic; they never move).
    """

    norm: Callable = nn.BatchNorm
    conv_bias: bool = True

    @nn.compact
    def __call__(self, x, train: bool):
        x = x.astype(jnp.float32) / 255.0
        for i, features in enumerate((32, 64)):
            x = nn.Conv(features, (3, 3), use_bias=self.conv_bias, name=f"Conv_{i}")(x)
            x = self.norm(use_running_average=not train, momentum=0.9, name=f"BatchNorm_{i}")(x)
            x = example.max_pool_2x2(nn.relu(x))
        x = nn.relu(nn.Dense(128, name="Dense_0")(x.reshape(x.shape[0], -1)))
        return nn.Dense(10, name="Dense_1")(x)


MODELS = {"example": example.CNN,
          "scaleshift": functools.partial(CNN, norm=ScaleShiftBatchNorm),
          "nobias": functools.partial(CNN, conv_bias=False),
          "nobias_scaleshift": functools.partial(CNN, norm=ScaleShiftBatchNorm, conv_bias=False)}


def create_state(model_name: str = "example", seed: int = 0) -> jdp.TrainState:
    """A fresh (unreplicated) train state for one of `MODELS`, SGD with momentum."""
    model = MODELS[model_name]()
    variables = model.init(jax.random.key(seed), jnp.zeros((1, 28, 28, 1), jnp.uint8),
                           train=False)
    return jdp.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                 tx=optax.sgd(LEARNING_RATE, momentum=MOMENTUM),
                                 model_state=variables["batch_stats"])


def host_batch(global_batch: int, seed: int = 0) -> dict:
    """Random MNIST-shaped examples on the host: uint8 images, int32 labels."""
    rng = np.random.default_rng(seed)
    return {"image": rng.integers(0, 256, (global_batch, 28, 28, 1), dtype=np.uint8),
            "label": rng.integers(0, 10, global_batch, dtype=np.int32)}


def device_batch(per_device: int, seed: int = 0) -> dict:
    """A batch `[local_devices, per_device, ...]` already placed on the local devices."""
    batch = jdp.shard(host_batch(per_device * jax.local_device_count(), seed))
    return jax.device_put(batch, local_sharding())


def jdp_step(apply_fn: Callable, **options) -> Callable:
    """The step exactly as `examples/mnist.py` builds it."""
    return jdp.train_step(lambda p, b, s: example.loss_fn(p, b, s, apply_fn), has_aux=True,
                          **options)


def hand_step(apply_fn: Callable) -> Callable:
    """A hand-written pmap step doing jdp's work: grads, BatchNorm statistics and metrics
    averaged over devices (XLA merges the three into one all-reduce), donated state."""
    def device_step(state, batch):
        def loss(params):
            return example.loss_fn(params, batch, state.model_state, apply_fn)
        (value, (metrics, stats)), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        state = state.apply_gradients(grads=lax.pmean(grads, jdp.AXIS))
        state = state.replace(model_state=lax.pmean(stats, jdp.AXIS))
        return state, lax.pmean({"loss": value, **metrics}, jdp.AXIS)

    return jax.pmap(device_step, axis_name=jdp.AXIS, donate_argnums=(0,))


def run_steps(step: Callable, state: Any, batch: Any, steps: int, in_flight: int = 2) -> Any:
    """Run `steps` steps and wait for the last; returns the new state.

    At most `in_flight` steps stay queued (waiting on the metrics of the step `in_flight`
    back), as jdp does internally: many queued multi-device CPU all-reduces can hang
    (RELIABILITY_NOTES), so a hand-written loop must bound them too. jdp's own bound makes
    the extra wait here a no-op for jdp steps.
    """
    pending: collections.deque = collections.deque()
    metrics = None
    for _ in range(steps):
        state, metrics = step(state, batch)
        pending.append(metrics)
        if len(pending) > in_flight:
            jax.block_until_ready(pending.popleft())
    jax.block_until_ready((state, metrics))
    return state
