"""The host time of jdp.ft's synchronous exchange per step, without the network: from a group's
gradients (global arrays, ready) to the reduced gradients placed for the update, for a state
replicated and one split (FSDP) over the process's devices. The all-reduce itself is left out
(its bytes are the same for both routes); what remains is what the process does around it.

- `buffers` (jdp.ft today, `jdp.ft._buffers`): the floating pieces flattened inside one
  compiled function, one buffer per device and wire dtype, to the host (on CPU the device's
  own memory), back, unflattened inside another compiled function.
- `pieces` (the reference: jdp 0.7's route, written out here): every leaf's pieces to host
  numpy arrays, cast to float32, concatenated per dtype, divided, cut apart, and put back on
  the devices piece by piece.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.ft_exchange \
        [--params N] [--leaves L] [--repeats R]     # JSON: median ms per route and layout
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np
import optax

import jdp
from jdp.ft import _buffers, _exchange


def state(params: int, leaves: int, **layout):
    """An Adam state of `leaves` float32 matrices of about `params` values in all."""
    rows = max(jax.device_count(), int((params / leaves / 64) // jax.device_count())
               * jax.device_count())
    values = {f"w{i}": np.full((rows, 64), i, np.float32) for i in range(leaves)}
    return jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=values,
                                               tx=optax.adam(1e-3)), **layout)


PLANS: dict = {}   # the plans made once, as a group keeps its own


def buffers_route(tree, divide):
    plan = _buffers.Buffers.of(tree, divide, PLANS)
    bufs = plan.flatten(tree)
    host = _buffers.to_host(bufs)
    return plan.unflatten(_buffers.back(bufs, host), tree, 1)


def pieces_route(tree, divide):
    del divide
    host = _exchange.to_host(tree)
    floats = [[v.astype(np.float32) for v in values] for values in host]
    flat = np.concatenate([v.reshape(-1) for values in floats for v in values])
    flat /= 1.0   # the mean over one group (every leaf here is a mean)
    out, at = [], 0
    for values in floats:
        row = []
        for v in values:
            row.append(flat[at:at + v.size].reshape(v.shape))
            at += v.size
        out.append(row)
    return _exchange.from_host(tree, out)


def timed(route, tree, divide) -> float:
    jax.block_until_ready(tree)
    began = time.perf_counter()
    jax.block_until_ready(route(tree, divide))
    return time.perf_counter() - began


def measure(params: int, leaves: int, repeats: int) -> dict:
    """Median seconds per route and layout, the two routes alternated in this process."""
    out = {}
    for name, layout in (("replicated", {}), ("FSDP", {"shard_params": True})):
        s = state(params, leaves, **layout)
        tree = (s.params, {}, {"loss": s.params["w0"][0, 0]})
        divide = (True,) * len(jax.tree.leaves(tree))
        routes = {"buffers": buffers_route, "pieces": pieces_route}
        for route in routes.values():   # compiled, warm
            timed(route, tree, divide)
        times: dict = {r: [] for r in routes}
        for _ in range(repeats):
            for r, route in routes.items():
                times[r].append(timed(route, tree, divide))
        out[name] = {r: statistics.median(t) for r, t in times.items()}
        out[name]["params"] = sum(x.size for x in jax.tree.leaves(s.params))
    out["devices"] = jax.device_count()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ft_exchange")
    p.add_argument("--params", type=int, default=10_000_000)
    p.add_argument("--leaves", type=int, default=40)
    p.add_argument("--repeats", type=int, default=11)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.params, args.leaves, args.repeats)))


if __name__ == "__main__":
    main()
