"""One accelerator: jdp's step on a real GPU against a hand-written `jax.jit` step.

`python -m benchmarks.gpu [--width 4096] [--layers 8] [--batch 2048] [--steps 30]` prints
the device, then a markdown table: for each placement (replicated, ZeRO, FSDP) and compute
dtype (float32, bf16), the median ms per step of jdp.train_step and of the hand-written step
(the same MLP, loss, Adam and batches, donated state), their ratio, and the largest parameter
difference after 3 steps from the same start. The two loops alternate in bursts in this one
process. On one device the placements' collectives are no-ops: what the rows measure is that
jdp's step adds nothing to the device's work and stays exact, in either dtype.
"""
from __future__ import annotations

import argparse
import functools
import statistics

from benchmarks import harness
from benchmarks.harness import report
from benchmarks.overhead import burst


def _model(width: int, layers: int, batch: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    params = {"w": (rng.standard_normal((layers, width, width)) / width ** 0.5).astype(np.float32),
              "b": np.zeros((layers, width), np.float32)}
    data = {"x": rng.standard_normal((batch, width)).astype(np.float32),
            "y": rng.standard_normal((batch, width)).astype(np.float32)}

    def loss_fn(p, b):
        def layer(h, wb):
            return jnp.tanh(h @ wb[0] + wb[1]), None
        out = jax.lax.scan(layer, b["x"], (p["w"], p["b"]))[0]
        return jnp.mean((out - b["y"]) ** 2)

    return params, data, loss_fn


def _hand_step(loss_fn, dtype):
    """The step a user writes for one device: cast, grad, Adam, donated state."""
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(state, batch):
        def cast_loss(p, b):
            cast = jax.tree.map(lambda x: x.astype(dtype), (p, b))
            return loss_fn(*cast).astype(jnp.float32)
        loss, grads = jax.value_and_grad(cast_loss)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss}
    return step


def _max_diff(a, b) -> float:
    import jax
    import numpy as np
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def measure(placing: str, dtype_name: str, width: int, layers: int, batch: int,
            steps: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    import jdp
    dtype = {"float32": jnp.float32, "bf16": jnp.bfloat16}[dtype_name]
    params, data, loss_fn = _model(width, layers, batch)
    tx = optax.adam(1e-3)
    opts = {"replicated": {}, "ZeRO": {"shard_optimizer": True},
            "FSDP": {"shard_params": True}}[placing]
    cast = {} if dtype_name == "float32" else {"compute_dtype": dtype}
    ours = jdp.train_step(loss_fn, **cast, **opts)
    hand = _hand_step(loss_fn, dtype)
    fresh = lambda: jdp.TrainState.create(apply_fn=None, params=params, tx=tx)  # noqa: E731
    states = {"jdp": jdp.broadcast(fresh(), **opts), "jax.jit": jax.device_put(fresh())}
    batches = {"jdp": jdp.shard(data), "jax.jit": jax.device_put(data)}
    runs = {"jdp": ours, "jax.jit": hand}
    for name in runs:   # compile, and 3 steps from the same start for the exactness column
        _, states[name] = burst(runs[name], states[name], batches[name], 3)
    diff = _max_diff(jdp.unshard(states["jdp"]).params, states["jax.jit"].params)

    def timed(name: str) -> float:
        seconds, states[name] = burst(runs[name], states[name], batches[name], steps)
        return seconds
    times = harness.interleave(timed, list(runs), reps)
    ratios = [a / b for a, b in zip(times["jdp"], times["jax.jit"], strict=True)]
    return {"placing": placing, "dtype": dtype_name, "diff": diff,
            "jdp_ms": statistics.median(times["jdp"]) * 1e3,
            "jit_ms": statistics.median(times["jax.jit"]) * 1e3,
            "ratio": statistics.median(ratios)}


def render(rows: list[dict]) -> str:
    return report.table(
        ["placement", "compute", "jax.jit ms / step", "jdp.train_step ms / step",
         "jdp / jax.jit", "max param diff after 3 steps"],
        [[r["placing"], r["dtype"], f"{r['jit_ms']:.3f}", f"{r['jdp_ms']:.3f}",
          f"{r['ratio']:.3f}", f"{r['diff']:.1e}"] for r in rows])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    import jax
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}; "
          f"{args.layers} scanned layers of {args.width}, batch {args.batch}, Adam\n")
    rows = [measure(placing, dtype, args.width, args.layers, args.batch, args.steps, args.reps)
            for dtype in ("float32", "bf16") for placing in ("replicated", "ZeRO", "FSDP")]
    print(render(rows), end="")


if __name__ == "__main__":
    main()
