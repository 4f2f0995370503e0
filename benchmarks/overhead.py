"""Host time per step: `jdp.train_step` against a hand-written `jax.jit` step, one device.

`python -m benchmarks.overhead [--leaves 10,300] [--reps 15] [--steps 300]` prints a markdown
table. Both steps do the same math on a model of L small leaves (SGD, donated state), so
the time per step is the host's: Python, pytree flattening and jit's dispatch. The two loops
alternate in short bursts (a b b a ...) in this one process, and the table gives the median
time per step of each and the median of the per-burst ratios.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time

from benchmarks import harness
from benchmarks.harness import report

DEVICES_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}


def _setup(leaves: int):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jdp

    def loss_fn(params, batch):
        return sum(jnp.mean(batch["x"] * p) for p in params.values())

    params = {f"w{i:03d}": np.full((4,), 0.01 * i, np.float32) for i in range(leaves)}
    state = jdp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    batch = {"x": np.ones((8, 4), np.float32)}

    @functools.partial(jax.jit, donate_argnums=(0,))
    def hand(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss}

    steps = {"jdp": (jdp.train_step(loss_fn), jdp.broadcast(state), jdp.shard(batch)),
             "jax.jit": (hand, jax.device_put(state), jax.device_put(batch))}
    return steps


def burst(step, state, batch, n: int):
    """`n` steps; seconds per step, and the state to continue from."""
    import jax

    start = time.perf_counter()
    for _ in range(n):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / n, state


def measure(leaves: int, reps: int, steps: int) -> dict:
    """Median seconds per step of each loop and the median per-burst ratio jdp / jax.jit."""
    variants = _setup(leaves)
    states = {k: v[1] for k, v in variants.items()}
    for name, (step, _, batch) in variants.items():   # compile and warm up
        _, states[name] = burst(step, states[name], batch, 20)

    def timed(name: str) -> float:
        step, _, batch = variants[name]
        seconds, states[name] = burst(step, states[name], batch, steps)
        return seconds
    times = harness.interleave(timed, list(variants), reps)
    ratios = [a / b for a, b in zip(times["jdp"], times["jax.jit"], strict=True)]
    return {"leaves": leaves, "jdp_us": statistics.median(times["jdp"]) * 1e6,
            "jit_us": statistics.median(times["jax.jit"]) * 1e6,
            "ratio": statistics.median(ratios), "lo": min(ratios), "hi": max(ratios)}


def table(leaves=(10, 300), reps: int = 15, steps: int = 300) -> str:
    """The markdown table, measured in a fresh process with one device."""
    cmd = [sys.executable, "-m", "benchmarks.overhead", "--rows", "--leaves",
           ",".join(map(str, leaves)), "--reps", str(reps), "--steps", str(steps)]
    out = subprocess.run(cmd, env={**os.environ, **DEVICES_ENV}, capture_output=True,
                         text=True, check=True, timeout=900)
    return out.stdout


def _render(rows: list[dict]) -> str:
    return report.table(
        ["model leaves", "jax.jit step (µs)", "jdp.train_step (µs)",
         "jdp / jax.jit (median, min-max over bursts)"],
        [[r["leaves"], f"{r['jit_us']:.1f}", f"{r['jdp_us']:.1f}",
          f"{r['ratio']:.3f} ({r['lo']:.2f}-{r['hi']:.2f})"] for r in rows])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", default="10,300")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rows", action="store_true", help="measure in this process")
    args = parser.parse_args(argv)
    leaves = [int(x) for x in args.leaves.split(",")]
    if args.rows:
        print(_render([measure(n, args.reps, args.steps) for n in leaves]), end="")
    else:
        print(table(leaves, args.reps, args.steps), end="")


if __name__ == "__main__":
    main()
