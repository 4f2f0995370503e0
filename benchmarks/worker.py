"""A JAX benchmark process: `python -m benchmarks.worker CONTROL_DIR VARIANT[,VARIANT...]`.

One process with k simulated devices, or one rank under `jdp.launch`: it compiles its variants
once, then answers requests (`benchmarks.harness`). Every variant trains `examples/mnist.py`'s
CNN with its loss, 64 examples per device, SGD momentum 0.9 at lr 0.05, donated state:
`jdp` (`jdp.train_step` on global arrays), `pmap` (the classic form, `jdp.pmap.train_step`),
`hand` (a hand-written `jax.pmap` + `lax.pmean` step) and `maxpool` (`jdp` with the CNN pooled
by flax's `nn.max_pool`, whose gradient is XLA:CPU's slow select-and-scatter).
"""
from __future__ import annotations

import collections
import functools
import importlib.util
import itertools
import sys
import time
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jdp
from benchmarks import harness
from benchmarks.harness import hlo, jobs

METRIC_SCALARS = 2  # the example's "loss" and "accuracy"


@functools.cache
def example(max_pool: bool = False):
    """A copy of examples/mnist.py (one per pooling); with `max_pool`, its CNN pools with
    `nn.max_pool`."""
    spec = importlib.util.spec_from_file_location("mnist_example", f"{jobs.REPO}/examples/mnist.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if max_pool:
        module.max_pool_2x2 = lambda x: nn.max_pool(x, (2, 2), (2, 2))
    return module


def hand_device_step(loss_fn):
    """jdp's per-device work written by hand: gradients, BatchNorm statistics and metrics
    averaged over `jdp.AXIS` (XLA merges them into one all-reduce)."""
    def device_step(state, batch):
        (value, (metrics, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, batch, state.model_state)
        state = state.apply_gradients(grads=lax.pmean(grads, jdp.AXIS))
        state = state.replace(model_state=lax.pmean(stats, jdp.AXIS))
        return state, lax.pmean({"loss": value, **metrics}, jdp.AXIS)
    return device_step


def hand_step(loss_fn):
    """`hand_device_step` under `jax.pmap`, donated state."""
    return jax.pmap(hand_device_step(loss_fn), axis_name=jdp.AXIS, donate_argnums=(0,))


class Variant(NamedTuple):
    step: Any
    state: Any
    batch: Any


def build(name: str, per_device: int) -> Variant:
    """A variant's step, its placed state and a fixed random batch."""
    ex = example(max_pool=name == "maxpool")
    v = jax.jit(ex.CNN().init, static_argnames="train")(
        jax.random.key(0), jnp.zeros((1, 28, 28, 1), jnp.uint8), train=False)
    state = jdp.TrainState.create(apply_fn=ex.CNN().apply, params=v["params"],
                                  tx=optax.sgd(0.05, momentum=0.9), model_state=v["batch_stats"])
    rng, size = np.random.default_rng(jax.process_index()), per_device * jax.local_device_count()
    data = {"image": rng.integers(0, 256, (size, 28, 28, 1), dtype=np.uint8),
            "label": rng.integers(0, 10, size, dtype=np.int32)}
    if name in ("jdp", "maxpool"):
        return Variant(jdp.train_step(ex.loss_fn, has_aux=True), jdp.broadcast(state),
                       next(iter(jdp.data.Loader(data, size))))
    step = hand_step(ex.loss_fn) if name == "hand" else jdp.pmap.train_step(ex.loss_fn,
                                                                            has_aux=True)
    return Variant(step, jdp.pmap.replicate(state),
                   next(iter(jdp.data.Loader(data, size, layout="pmap"))))


class Bench:
    """This process's variants and the request handlers over them (`OPS`)."""

    OPS = ("time", "paired", "hlo", "profile", "loader")

    def __init__(self, names: list[str], per_device: int = 64):
        self.global_batch = per_device * jax.device_count()
        self.variants = {n: build(n, per_device) for n in names}
        for name in self.variants:  # compile and warm up
            self._run(name, 3)

    def _run(self, name: str, steps: int) -> None:
        """`steps` steps, at most 2 queued (as jdp bounds its own: many queued multi-device
        CPU all-reduces can stall XLA's rendezvous)."""
        v, pending = self.variants[name], collections.deque()
        state = v.state
        for _ in range(steps):
            state, metrics = v.step(state, v.batch)
            pending.append(metrics)
            if len(pending) > 2:
                jax.block_until_ready(pending.popleft())
        self.variants[name] = v._replace(state=jax.block_until_ready((state, list(pending)))[0])

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

    def _compiled(self, name: str):
        v = self.variants[name]
        return v.step.lower(v.state, v.batch).compile()

    def hlo(self, request: dict) -> dict:
        """All-reduce ops and bytes of the compiled step, what the trees predict, and the
        step's scratch memory per device (what glibc's mmap threshold applies to)."""
        name = request["variant"]
        compiled, state = self._compiled(name), self.variants[name].state
        one = jdp.pmap.unreplicate(state)  # global leaves come back as they are
        return {**hlo.collectives(compiled.as_text())["all-reduce"]._asdict(),
                "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                "expected_bytes": hlo.expected_bytes(one.params, one.model_state,
                                                     METRIC_SCALARS)}

    def profile(self, request: dict) -> dict:
        """CPU milliseconds per step by kind of op (`benchmarks.harness.profile`)."""
        from benchmarks.harness import profile
        name = request["variant"]
        return profile.breakdown(lambda n: self._run(name, n),
                                 self._compiled(name).as_text(), request["steps"])

    def loader(self, request: dict) -> dict:
        """Samples/s of `jdp.data.Loader` over a shuffled MNIST-shaped epoch (60000 uint8
        28x28x1 images, int32 labels), every batch waited for on the devices."""
        size = request["batch_size"] * request["num_batches"]
        loader = jdp.data.Loader(mnist_shaped(), request["batch_size"], shuffle=True,
                                 drop_last=True)
        start = time.perf_counter()
        for batch in itertools.islice(loader, request["num_batches"]):
            jax.block_until_ready(batch)
        return {"samples_per_s": size / (time.perf_counter() - start)}


@functools.cache
def mnist_shaped() -> dict:
    """Random data of MNIST's shapes, made once per process (not in every round)."""
    rng = np.random.default_rng(0)
    return {"image": rng.integers(0, 256, (60000, 28, 28, 1), dtype=np.uint8),
            "label": rng.integers(0, 10, 60000, dtype=np.int32)}


if __name__ == "__main__":
    jdp.initialize()
    bench = Bench(sys.argv[2].split(","))
    harness.serve(sys.argv[1], {op: getattr(bench, op) for op in bench.OPS},
                  primary=jax.process_index() == 0, info={"variants": list(bench.variants)})
