"""Optimizer-state sharding (ZeRO-1) against replication: memory, collective traffic, time.

An MLP of three square tanh layers with Adam; each device count in a fresh process
(`python -m benchmarks.zero PARAMS` prints one JSON line). Per device: optimizer-state bytes
from the shardings, arguments and scratch from `memory_analysis()`, collectives from the HLO,
and ms per step, replicated and `shard_optimizer=True` alternated.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdp
from benchmarks import hlo, jobs, report


def _loss(params, batch):
    """Mean squared error of the MLP against random targets: any differentiable loss does."""
    x = batch["x"]
    for i in range(3):
        x = jnp.tanh(x @ params[f"w{i}"])
    return jnp.mean((x - batch["y"]) ** 2)


def _build(params: int, shard: bool, per_device: int = 8) -> dict:
    """Place the state, compile the step, read memory and collectives from the compiled step."""
    d = max(8, int((params / 3) ** 0.5) // 8 * 8)
    rng, size = np.random.default_rng(0), per_device * jax.local_device_count()
    weights = {f"w{i}": rng.standard_normal((d, d), np.float32) / d ** 0.5 for i in range(3)}
    data = {k: rng.standard_normal((size, d), np.float32) for k in ("x", "y")}
    batch = next(iter(jdp.data.Loader(data, size)))
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=weights,
                                                tx=optax.adam(1e-4)), shard_optimizer=shard)
    step = jdp.train_step(_loss, shard_optimizer=shard)
    compiled = step.lower(state, batch).compile()
    memory, found = compiled.memory_analysis(), hlo.collectives(compiled.as_text())
    return {"step": step, "state": state, "batch": batch, "figures": {
        "params": 3 * d * d, "argument": memory.argument_size_in_bytes,
        "temp": memory.temp_size_in_bytes, "ring": hlo.ring_bytes(found, jax.device_count()),
        "opt": sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.opt_state)),
        **{kind: c.bytes for kind, c in found.items()}}}


def _ms_per_step(b: dict, steps: int) -> float:
    """Milliseconds per step over `steps` steps, after one untimed step."""
    b["state"], metrics = b["step"](b["state"], b["batch"])
    start = time.perf_counter()
    for _ in range(steps):
        b["state"], metrics = b["step"](b["state"], b["batch"])
    jax.block_until_ready((b["state"], metrics))
    return (time.perf_counter() - start) * 1e3 / steps


def measure(params: int, steps: int = 2, rounds: int = 2) -> dict:
    """Both modes' figures on this process's devices, the two timed alternately."""
    built = {mode: _build(params, shard=mode == "sharded") for mode in ("replicated", "sharded")}
    times = {mode: [] for mode in built}
    for r in range(rounds):
        for mode in list(built)[:: 1 if r % 2 == 0 else -1]:
            times[mode].append(_ms_per_step(built[mode], steps))
    return {m: {**b["figures"], "ms": statistics.median(times[m])} for m, b in built.items()}


def _row(n: int, rep: dict, sh: dict) -> list:
    """One device count's row; pairs are "replicated / sharded", bytes in MiB per device."""
    def pair(key: str, scale: float = 2**20) -> str:
        return " / ".join(report.fmt(x[key] / scale, 1) for x in (rep, sh))
    return [n, f"{rep['params']:,}", pair("opt"), report.fmt(sh["opt"] / rep["opt"], 3),
            f"{1 / n:.3f}", pair("argument"), pair("temp"), pair("all-reduce"),
            " + ".join(report.fmt(sh[k] / 2**20, 1) for k in ("reduce-scatter", "all-gather")),
            pair("ring"), pair("ms", 1), report.fmt(rep["ms"] / sh["ms"])]


def table(r: dict) -> str:
    """Per device count (one fresh process each): replicated against sharded optimizer state."""
    rows, failed = [], []
    for n in r["settings"]["zero_devices"]:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.zero",
                               str(r["settings"]["zero_params"])], cwd=jobs.REPO, text=True,
                              env=jobs.base_env("tuned", XLA_FLAGS=jobs.device_flags(n)),
                              capture_output=True, timeout=1200)
        if proc.returncode:
            failed.append(f"\n- {n} devices failed: {proc.stderr.strip()[-300:]}")
            continue
        c = json.loads(proc.stdout.splitlines()[-1])
        rows.append(_row(n, c["replicated"], c["sharded"]))
    return report.table(
        ["devices", "parameters", "opt state MiB (shardings)", "sharded / replicated", "1/N",
         "step arguments MiB (memory_analysis)", "step scratch MiB", "all-reduce MiB (HLO)",
         "sharded: reduce-scatter + all-gather MiB", "ring MiB sent", "ms / step",
         "speed sharded / replicated"], rows) + "".join(failed)


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]))))
