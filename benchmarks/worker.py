"""A JAX benchmark process: `python -m benchmarks.worker CONTROL_DIR VARIANT[,VARIANT...]`.

With k simulated devices, or as one rank under `jdp.launch`: it compiles its variants once,
then answers requests (`benchmarks.harness`). Each trains `examples/mnist.py`'s CNN, its loss,
64 examples per device, SGD momentum 0.9 at lr 0.05 (as the PyTorch peer), donated state:

    jdp       jdp.train_step as examples/mnist.py builds it (stacked pmap layout)
    hand      a hand-written jax.pmap + lax.pmean step doing the same work
    shardmap  jdp.train_step(..., backend="shard_map")
    maxpool   jdp with the CNN pooled by flax's `nn.max_pool`, as flax code usually pools: its
              gradient is XLA's select-and-scatter, slow on CPU, which reshape-and-max avoids
    global    jdp.broadcast state + Loader(layout="global") batch, same jdp.train_step
"""
from __future__ import annotations

import collections
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jdp
from benchmarks import harness, hlo

_spec = importlib.util.spec_from_file_location("jdp_examples_mnist", os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "mnist.py"))
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)
METRIC_SCALARS = 2  # "loss" and the example's "accuracy"
OPS = ("time", "paired", "hlo", "profile", "loader")  # the requests a worker answers


class MaxPoolCNN(nn.Module):
    """The example's CNN with `nn.max_pool(x, (2, 2), (2, 2))`."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = x.astype(jnp.float32) / 255.0
        for features in (32, 64):
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(
                nn.Conv(features, (3, 3))(x))
            x = nn.max_pool(nn.relu(x), (2, 2), (2, 2))
        return nn.Dense(10)(nn.relu(nn.Dense(128)(x.reshape(x.shape[0], -1))))


def loss_of(model: nn.Module) -> Callable:
    """The example's loss for `model`: mean cross-entropy, accuracy, new BatchNorm statistics."""
    def loss_fn(params, batch, batch_stats):
        logits, updates = model.apply({"params": params, "batch_stats": batch_stats},
                                      batch["image"], train=True, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        accuracy = (logits.argmax(-1) == batch["label"]).mean()
        return loss, ({"accuracy": accuracy}, updates["batch_stats"])
    return loss_fn


def hand_step(loss_fn: Callable) -> Callable:
    """A hand-written pmap step doing jdp's work: gradients, BatchNorm statistics and metrics
    averaged over devices (XLA merges them into one all-reduce), donated state."""
    def device_step(state, batch):
        def loss(params):
            return loss_fn(params, batch, state.model_state)
        (value, (metrics, stats)), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        state = state.apply_gradients(grads=lax.pmean(grads, jdp.AXIS))
        state = state.replace(model_state=lax.pmean(stats, jdp.AXIS))
        return state, lax.pmean({"loss": value, **metrics}, jdp.AXIS)

    return jax.pmap(device_step, axis_name=jdp.AXIS, donate_argnums=(0,))


class Variant(NamedTuple):
    step: Callable
    state: Any
    batch: Any


def build(name: str, per_device: int) -> Variant:
    """A step variant with its placed state and a fixed random batch."""
    model = MaxPoolCNN() if name == "maxpool" else example.CNN()
    v = model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1), jnp.uint8), train=False)
    state = jdp.TrainState.create(apply_fn=model.apply, params=v["params"],
                                  tx=optax.sgd(0.05, momentum=0.9), model_state=v["batch_stats"])
    rng, size = np.random.default_rng(jax.process_index()), per_device * jax.local_device_count()
    data = {"image": rng.integers(0, 256, (size, 28, 28, 1), dtype=np.uint8),
            "label": rng.integers(0, 10, size, dtype=np.int32)}
    step = jdp.train_step(loss_of(model), has_aux=True,
                          **({"backend": "shard_map"} if name == "shardmap" else {}))
    layout = "global" if name == "global" else "pmap"
    batch = next(iter(jdp.data.Loader(data, size, layout=layout)))
    if name == "global":
        return Variant(step, jdp.broadcast(state), batch)
    return Variant(hand_step(loss_of(model)) if name == "hand" else step, jdp.replicate(state),
                   batch)


class Bench:
    """The variants of this process and the request handlers over them."""

    def __init__(self, names: list[str], per_device: int = 64):
        self.global_batch = per_device * jax.device_count()
        self.variants = {n: build(n, per_device) for n in names
                         if n != "global" or hasattr(jdp, "broadcast")}
        for name in self.variants:  # compile and warm up
            self._run(name, 3)

    def _run(self, name: str, steps: int) -> None:
        """`steps` steps of a variant, at most 2 queued (many queued multi-device CPU
        all-reduces can stall XLA's rendezvous; jdp bounds its own the same way)."""
        v, pending, metrics = self.variants[name], collections.deque(), None
        state = v.state
        for _ in range(steps):
            state, metrics = v.step(state, v.batch)
            pending.append(metrics)
            if len(pending) > 2:
                jax.block_until_ready(pending.popleft())
        self.variants[name] = v._replace(state=jax.block_until_ready((state, metrics))[0])

    def time(self, request: dict) -> dict:
        """`harness.timed` over `steps` steps, after one untimed step that lines ranks up."""
        self._run(request["variant"], 1)
        return harness.timed(lambda: self._run(request["variant"], request["steps"]),
                             request["steps"], self.global_batch)

    def paired(self, request: dict) -> dict:
        """Throughput ratio a / b from short bursts alternated a b b a ...: both see the same
        load, a finer measure than round-to-round ratios."""
        seconds = {request["a"]: 0.0, request["b"]: 0.0}
        for i in range(request["reps"]):
            for name in (request["a"], request["b"])[:: 1 if i % 2 == 0 else -1]:
                self._run(name, 1)
                start = time.perf_counter()
                self._run(name, request["steps"])
                seconds[name] += time.perf_counter() - start
        return {"ratio": seconds[request["b"]] / seconds[request["a"]]}

    def _compiled(self, name: str) -> Any:
        v = self.variants[name]
        return v.step.lower(v.state, v.batch).compile()

    def hlo(self, request: dict) -> dict:
        """All-reduce ops and bytes of the compiled step, what the trees predict, and the
        step's scratch memory per device (what glibc's mmap threshold applies to)."""
        name = request["variant"]
        compiled = self._compiled(name)
        found = hlo.collectives(compiled.as_text())["all-reduce"]
        state = self.variants[name].state
        one = state if name == "global" else jdp.unreplicate(state)
        return {**found._asdict(), "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                "expected_bytes": hlo.expected_bytes(one.params, one.model_state,
                                                     METRIC_SCALARS)}

    def profile(self, request: dict) -> dict:
        """CPU milliseconds per step by kind of op (`benchmarks.profile`)."""
        from benchmarks import profile
        name = request["variant"]
        return profile.breakdown(lambda n: self._run(name, n),
                                 self._compiled(name).as_text(), request["steps"])

    def loader(self, request: dict) -> dict:
        """One run of `bench_loader.loader_throughput`: {"samples_per_s": ...}."""
        from benchmarks.bench_loader import loader_throughput
        return {"samples_per_s": loader_throughput(batch_size=request["batch_size"],
                                                   num_batches=request["num_batches"], runs=1)}


if __name__ == "__main__":
    jdp.initialize()
    bench = Bench(sys.argv[2].split(","))
    harness.serve(sys.argv[1], {op: getattr(bench, op) for op in OPS},
                  primary=jax.process_index() == 0, info={"variants": list(bench.variants)})
