"""Sharded training state against replication: memory at rest and at peak, traffic, time.

An MLP of three square tanh layers with Adam, trained five ways on one mesh: replicated, ZeRO
(`shard_optimizer=True`), FSDP (`shard_params=True`), FSDP computing in bfloat16
(`compute_dtype=jnp.bfloat16`: the parameters gathered in bf16) and the same with the gradients
reduced in bf16 too (`comm_dtype=jnp.bfloat16`). Each device count runs in a fresh process
(`python -m benchmarks.zero PARAMS` prints one JSON line). Per device: parameters + optimizer
state at rest (from the arrays' shards), the compiled step's peak (XLA's buffer assignment,
`memory_analysis()`: arguments + outputs - aliased (donated) + temporaries), the collectives'
result bytes from the HLO, and ms per step, each mode alternated with the replicated step.
Children run with glibc's default allocator (`JDP_MALLOC_TUNING=0`): with jdp's tuning (large
blocks from the heap, never mmap'd; trimmed only past 1 GiB) the 8-device child's resident
memory reached 20 GB instead of 10 GB, more than the benchmark machine can spare.
"""
from __future__ import annotations

import gc
import json
import re
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdp
from benchmarks import fsdp_layers
from benchmarks.harness import hlo, jobs, report

# mode -> options of both jdp.broadcast (the two shard_* flags) and jdp.train_step (all).
MODES = {
    "replicated": {},
    "ZeRO": {"shard_optimizer": True},
    "FSDP": {"shard_params": True},
    "FSDP bf16": {"shard_params": True, "compute_dtype": jnp.bfloat16},
    "FSDP bf16 + bf16 grads": {"shard_params": True, "compute_dtype": jnp.bfloat16,
                               "comm_dtype": jnp.bfloat16},
}
BUDGET = 2 * 2**30  # the per-device memory of "the largest MLP that fits"
MiB = 2**20


def _loss(params, batch):
    """Mean squared error of the MLP against random targets: any differentiable loss does."""
    x = batch["x"]
    for i in range(3):
        x = jnp.tanh(x @ params[f"w{i}"])
    return jnp.mean((x - batch["y"]) ** 2)


def _per_device(tree) -> int:
    """Bytes one device holds of a tree of global arrays (its first shard of every leaf)."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def _build(params: int, options: dict, per_device: int = 8) -> dict:
    """Place the state, compile the step, read memory and collectives from the compiled step."""
    d = max(8, int((params / 3) ** 0.5) // 8 * 8)
    rng, size = np.random.default_rng(0), per_device * jax.local_device_count()
    weights = {f"w{i}": rng.standard_normal((d, d), np.float32) / d ** 0.5 for i in range(3)}
    data = {k: rng.standard_normal((size, d), np.float32) for k in ("x", "y")}
    batch = next(iter(jdp.data.Loader(data, size)))
    placing = {k: v for k, v in options.items() if k.startswith("shard_")}
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=weights,
                                                tx=optax.adam(1e-4)), **placing)
    step = jdp.train_step(_loss, **options)
    lowered = step.lower(state, batch)
    compiled = lowered.compile()
    m, found = compiled.memory_analysis(), hlo.collectives(compiled.as_text())
    asked = _lowered_collectives(lowered)
    return {"step": step, "state": state, "batch": batch, "figures": {
        "params": 3 * d * d, "rest": _per_device((state.params, state.opt_state)),
        "argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
        "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
        "peak": (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                 + m.temp_size_in_bytes),
        "ring": hlo.ring_bytes(found, jax.device_count()),
        **{kind: c.bytes for kind, c in found.items()},
        **{f"lowered {kind}": c.bytes for kind, c in asked.items()}}}


def _lowered_collectives(lowered) -> dict:
    """The collectives the program asks for, in their own dtypes, before XLA optimizes it (the
    lowered HLO names its instructions without the `%` the compiled text has)."""
    text = re.sub(r"^(\s*(?:ROOT\s+)?)(?=[\w.\-]+\s*=)", r"\1%",
                  lowered.as_text(dialect="hlo"), flags=re.M)
    return hlo.collectives(text)


def _ms_per_step(b: dict, steps: int) -> float:
    """Milliseconds per step over `steps` steps, after one untimed step."""
    b["state"], metrics = b["step"](b["state"], b["batch"])
    start = time.perf_counter()
    for _ in range(steps):
        b["state"], metrics = b["step"](b["state"], b["batch"])
    jax.block_until_ready((b["state"], metrics))
    return (time.perf_counter() - start) * 1e3 / steps


def measure(params: int, steps: int = 2, rounds: int = 2) -> dict:
    """Every mode's figures on this process's devices. Each mode is built after the previous
    one is freed (the replicated state of 50M parameters on 8 devices alone takes 7 GB) and
    timed alternately with the replicated step: its ratio is the median over rounds of the two
    timed in the same round."""
    rep = _build(params, MODES["replicated"])
    rep_ms, out = [], {"replicated": rep["figures"]}
    for mode in list(MODES)[1:]:
        b, times, ratios = _build(params, MODES[mode]), [], []
        for r in range(rounds):
            pair = [rep, b] if r % 2 == 0 else [b, rep]
            ms = {id(x): _ms_per_step(x, steps) for x in pair}
            rep_ms.append(ms[id(rep)])
            times.append(ms[id(b)])
            ratios.append(ms[id(b)] / ms[id(rep)])
        out[mode] = {**b["figures"], "ms": statistics.median(times),
                     "ratio": statistics.median(ratios)}
        del b
        gc.collect()
    out["replicated"].update(ms=statistics.median(rep_ms), ratio=1.0)
    return out


def largest(figures: dict, key: str, budget: int = BUDGET) -> float:
    """Parameters of the largest MLP whose `key` bytes ("rest" or "peak") fit `budget` per
    device, from this mode's measured bytes per parameter (memory of this MLP scales with its
    parameters; the activations of 8 examples per device are a fraction of a percent here)."""
    return budget / (figures[key] / figures["params"])


def _rows(n: int, c: dict) -> list[list]:
    """One device count's rows: one per mode, bytes in MiB per device."""
    rep, rows = c["replicated"], []
    for mode, f in c.items():
        rows.append([n, mode, f"{f['params']:,}", report.fmt(f["rest"] / MiB, 1),
                     report.fmt(f["rest"] / rep["rest"], 3), f"{1 / n:.3f}",
                     report.fmt(f["peak"] / MiB, 1), report.fmt(f["temp"] / MiB, 1),
                     *(" / ".join(report.fmt(f[k] / MiB, 1) for k in (f"lowered {kind}", kind))
                       for kind in ("all-gather", "reduce-scatter")),
                     report.fmt(f["all-reduce"] / MiB, 1), report.fmt(f["ring"] / MiB, 1),
                     report.fmt(f["ms"], 0), report.fmt(f["ratio"]),
                     report.fmt(largest(f, "rest") / 1e6, 0),
                     report.fmt(largest(f, "peak") / 1e6, 0)])
    return rows


HEADER = ["devices", "mode", "parameters", "params + opt state MiB at rest",
          "at rest / replicated", "1/N", "step peak MiB (memory_analysis)", "of which temp MiB",
          "all-gather MiB (HLO: lowered / compiled)", "reduce-scatter MiB (lowered / compiled)",
          "all-reduce MiB (compiled)", "ring MiB sent (compiled)",
          "ms / step", "time / replicated", f"largest MLP in {BUDGET // 2**30} GiB, M params: "
          "at rest", "at peak"]


def table(r: dict) -> str:
    """Per device count (one fresh process each): every mode's memory, traffic and time."""
    rows, failed = [], []
    for n in r["settings"]["zero_devices"]:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.zero",
                               str(r["settings"]["zero_params"])], cwd=jobs.REPO, text=True,
                              env=jobs.base_env("default", XLA_FLAGS=jobs.device_flags(n)),
                              capture_output=True, timeout=1200)
        if proc.returncode:
            failed.append(f"\n- {n} devices failed (exit {proc.returncode}): "
                          f"{proc.stderr.strip()[-300:]}")
            continue
        rows += _rows(n, json.loads(proc.stdout.splitlines()[-1]))
    note = ("Per device. Peak: arguments + outputs - donated (aliased) + temporaries of the "
            "compiled step (`memory_analysis()`). Collectives: result bytes of each kind, in the "
            "lowered HLO (what the step asks for, in its dtypes; ZeRO's all-gather is added "
            "later by the partitioner) and in the compiled HLO (what runs here: XLA:CPU widens "
            "bf16 collectives to float32). Largest MLP: "
            f"{BUDGET // 2**30} GiB / this mode's measured bytes per parameter (at rest, at "
            "peak), computed, not tried.\n\n")
    deep = "\n\n**Deep models, one layer at a time.** " + fsdp_layers.table(r)
    return note + report.table(HEADER, rows) + "".join(failed) + deep


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]))))
