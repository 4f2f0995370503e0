"""A JAX benchmark process: `python -m benchmarks.worker --control DIR [options]`.

Started by `benchmarks.run` with `XLA_FLAGS=--xla_force_host_platform_device_count=k` (one
process, k devices) or under `python -m jdp.launch` (one rank of a multi-process job). It builds
the requested step variants, compiles and warms them up, then answers the parent's requests
(`benchmarks.protocol`):

    {"op": "time", "variant": "jdp", "steps": 20}  -> {"seconds": ..., "samples": ..., faults}
    {"op": "paired", "a": "jdp", "b": "hand", "steps": 5, "reps": 6} -> {"ratio": ...}
    {"op": "hlo", "variant": "jdp"}                -> all-reduce ops/bytes and the expected bytes
    {"op": "profile", "variant": "jdp", "steps": 5} -> CPU ms per step by layer and pass
    {"op": "loader", ...}                          -> jdp.data.Loader throughput (benchmarks.loader)

Variants (all the example's CNN and loss, SGD momentum, donated state):
    jdp             jdp.train_step, as examples/mnist.py builds it
    hand            a hand-written jax.pmap + lax.pmean step doing the same work
    shardmap        jdp.train_step(..., backend="shard_map"): jit + shard_map instead of pmap
    jdp_<model>     jdp.train_step over another formulation of the CNN (cnn.MODELS), e.g.
                    jdp_scaleshift: scale-and-shift BatchNorm
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

import jdp
from benchmarks import cnn, hlo, malloc, protocol

METRIC_SCALARS = 2  # "loss" and the example's "accuracy"


class Variant(NamedTuple):
    step: Callable
    state: Any


def build(name: str) -> Variant:
    """A step variant and its replicated state."""
    model = name.split("_", 1)[1] if name.startswith("jdp_") else "example"
    state = cnn.create_state(model)
    if name == "hand":
        step = cnn.hand_step(state.apply_fn)
    elif name == "shardmap":
        step = cnn.jdp_step(state.apply_fn, backend="shard_map")
    else:
        step = cnn.jdp_step(state.apply_fn)
    return Variant(step, jdp.replicate(state))


class Bench:
    """The variants of this process and the request handlers over them."""

    def __init__(self, names: list[str], per_device: int):
        self.per_device = per_device
        self.batch = cnn.device_batch(per_device, seed=jax.process_index())
        self.global_batch = per_device * jax.device_count()
        self.variants = {name: build(name) for name in names}
        for name in names:  # compile and warm up
            self._run(name, 3)

    def _run(self, name: str, steps: int) -> None:
        """Run `steps` steps of a variant (waiting for the last) and keep its new state."""
        variant = self.variants[name]
        state = cnn.run_steps(variant.step, variant.state, self.batch, steps)
        self.variants[name] = variant._replace(state=state)

    def time(self, request: dict) -> dict:
        """Seconds for `steps` steps after one untimed step that lines the ranks up, and
        this process's page faults and CPU time over them (`protocol.timed`)."""
        self._run(request["variant"], 1)
        return protocol.timed(lambda: self._run(request["variant"], request["steps"]),
                              request["steps"], self.global_batch)

    def paired(self, request: dict) -> dict:
        """Throughput ratio of variant "a" to variant "b", alternating them `reps` times
        (a b b a a b ...) in short bursts, so that both see the same load; for comparisons
        finer than the round-to-round noise (jdp's wrapper against a hand-written step)."""
        seconds = {request["a"]: 0.0, request["b"]: 0.0}
        for i in range(request["reps"]):
            for name in (request["a"], request["b"])[::1 if i % 2 == 0 else -1]:
                self._run(name, 1)
                start = time.perf_counter()
                self._run(name, request["steps"])
                seconds[name] += time.perf_counter() - start
        return {"ratio": seconds[request["b"]] / seconds[request["a"]]}

    def hlo(self, request: dict) -> dict:
        """All-reduce ops and bytes of the compiled step, the bytes the trees predict, and
        the step's scratch memory per device (what glibc's mmap threshold applies to)."""
        variant = self.variants[request["variant"]]
        compiled = variant.step.lower(variant.state, self.batch).compile()
        found = hlo.all_reduces(compiled.as_text())
        one = jdp.unreplicate(variant.state)
        return {"ops": found.ops, "bytes": found.bytes, "arrays": found.arrays,
                "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                "param_bytes": hlo.tree_bytes(one.params),
                "model_state_bytes": hlo.tree_bytes(one.model_state, floating_only=True),
                "metric_scalars": METRIC_SCALARS,
                "expected_bytes": hlo.expected_bytes(one.params, one.model_state,
                                                     METRIC_SCALARS)}

    def profile(self, request: dict) -> dict:
        """CPU milliseconds per step by layer and pass (benchmarks.profile)."""
        from benchmarks import profile
        name = request["variant"]
        variant = self.variants[name]
        text = variant.step.lower(variant.state, self.batch).compile().as_text()
        return profile.breakdown(lambda n: self._run(name, n), text, request["steps"])

    def loader(self, request: dict) -> dict:
        """One loader-throughput measurement (benchmarks.loader)."""
        from benchmarks import loader
        return loader.measure(request)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--control", required=True, help="directory of requests and answers")
    p.add_argument("--variants", default="jdp", help="comma-separated variant names")
    p.add_argument("--per-device", type=int, default=64, help="examples per device per step")
    p.add_argument("--malloc", choices=["default", "tuned"], default="default",
                   help="tuned: jdp._malloc.tune() (no per-step mmap of XLA's scratch)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    """Tune the allocator if asked, join the job, build the variants, serve requests."""
    args = parse_args(argv)
    tuned = args.malloc == "tuned" and malloc.tune()
    jdp.initialize()
    bench = Bench(args.variants.split(","), args.per_device)
    info = {"devices": jax.device_count(), "local_devices": jax.local_device_count(),
            "processes": jax.process_count(), "global_batch": bench.global_batch,
            "variants": list(bench.variants), "malloc_tuned": tuned}
    protocol.serve(args.control, {"time": bench.time, "paired": bench.paired, "hlo": bench.hlo,
                                 "profile": bench.profile,
                                 "loader": bench.loader},
                   primary=jax.process_index() == 0, info=info)


if __name__ == "__main__":
    main()
