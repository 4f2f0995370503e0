"""Deep models under FSDP: the compiled peak per device when layers are gathered one at a time.

An MLP of L square tanh layers stacked `[L, D, D]` and run by `lax.scan`, each layer under
`jax.checkpoint`, Adam, 16 examples per device, 8 devices, trained six ways: jdp replicated,
ZeRO (`shard_optimizer`), FSDP (`shard_params`), FSDP computing in bf16, and two hand-written
`shard_map` steps on a sharded state: one whose scan body all-gathers only its layer (the
per-layer reference) and one that all-gathers the whole model at the top of the step and
reduce-scatters its gradient (what jdp's FSDP did before it let the compiler place the
gathers; the time baseline). The same for
the layers unrolled (a Python loop, each layer under `jax.checkpoint`). Per device: parameters
+ optimizer state at rest, the compiled peak (`memory_analysis()`: arguments + outputs -
aliased + temporaries), ms per step, alternated with the whole-model step in one process.
And HSDP (`shard_params=4`) beside replicated, ZeRO and FSDP with the 8 devices seen as 2
nodes of 4: the bytes of the compiled collectives that cross nodes.
`python -m benchmarks.fsdp_layers WIDTH` prints one JSON line (run it with 8 devices).
"""
from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jdp
from benchmarks.harness import hlo, jobs, report

LAYERS = (8, 16, 64)
PER_DEVICE = 16
BUDGET = 2 * 2**30
MiB = 2**20
TX = optax.adam(1e-4)
JDP_MODES = {"replicated": {}, "ZeRO": {"shard_optimizer": True},
             "FSDP": {"shard_params": True},
             "FSDP bf16": {"shard_params": True, "compute_dtype": jnp.bfloat16}}


def _scanned(w, x, gather=lambda w: w):
    def layer(h, w):
        return jnp.tanh(h @ gather(w)), None
    return lax.scan(jax.checkpoint(layer), x, w)[0]


def _unrolled(w, x, gather=lambda w: w):
    for i in range(w.shape[0]):
        x = jax.checkpoint(lambda h, w: jnp.tanh(h @ gather(w)))(x, w[i])
    return x


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


def _per_device(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def _data(layers: int, width: int):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((layers, width, width)) / width ** 0.5).astype(np.float32)
    rows = PER_DEVICE * jax.device_count()
    return {"w": w}, jdp.shard({k: rng.standard_normal((rows, width), np.float32)
                                for k in "xy"})


def _jdp_step(model, params, batch, options) -> dict:
    placing = {k: v for k, v in options.items() if k.startswith("shard_")}
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=TX), **placing)
    step = jdp.train_step(
        lambda p, b: jnp.mean((model(p["w"], b["x"]) - b["y"]) ** 2), **options)
    compiled = step.lower(state, batch).compile()
    return {"run": step, "args": [state, batch], "peak": _peak(compiled),
            "rest": _per_device((state.params, state.opt_state))}


def _hand_step(model, params, batch, per_layer: bool) -> dict:
    """shard_map steps on the split state: the per-layer reference (split on the layers' rows,
    each layer gathered inside the loop), or jdp's FSDP before it left the gathers to the
    compiler (split on the leading axis, the whole model gathered at the top of the step, its
    gradient reduce-scattered, the update on the split arrays at jit level)."""
    n = jax.device_count()
    split = NamedSharding(jdp.mesh(), P(None, jdp.AXIS) if per_layer else P(jdp.AXIS))
    gather = lambda w: lax.all_gather(w, jdp.AXIS, axis=0, tiled=True)  # noqa: E731

    def per_device(p, b):
        def loss(p):
            out = model(p["w"], b["x"], gather) if per_layer else model(p["w"], b["x"])
            return jnp.mean((out - b["y"]) ** 2) / n
        if per_layer:
            return jax.grad(loss)(p)
        grads = jax.grad(loss)(jax.tree.map(gather, p))
        return jax.tree.map(lambda g: lax.psum_scatter(g, jdp.AXIS, tiled=True), grads)

    def step(p, o, b):
        spec = jax.tree.map(lambda _: split.spec, p)
        grads = jax.shard_map(per_device, mesh=jdp.mesh(), in_specs=(spec, P(jdp.AXIS)),
                              out_specs=spec, check_vma=False)(p, b)
        u, o = TX.update(grads, o, p)
        return optax.apply_updates(p, u), o

    p, o = jax.device_put(params, split), _placed_opt(params, split)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(p, o, batch).compile()
    return {"run": lambda p, o, b: (*compiled(p, o, b), None), "args": [p, o, batch],
            "peak": _peak(compiled), "rest": _per_device((p, o)), "hand": True}


def _placed_opt(params, rows):
    replicated = NamedSharding(jdp.mesh(), P())
    return jax.tree.map(lambda x: jax.device_put(x, rows if np.ndim(x) else replicated),
                        TX.init(params))


def _ms(b: dict, steps: int) -> float:
    """Milliseconds per step over `steps` steps after one untimed step (state threaded)."""
    def one():
        out = b["run"](*b["args"])
        if b.get("hand"):
            b["args"][:2] = out[:2]
        else:
            b["args"][0] = out[0]
        return out
    one()
    start = time.perf_counter()
    for _ in range(steps):
        out = one()
    jax.block_until_ready(out[:2])
    return (time.perf_counter() - start) * 1e3 / steps


def _builders(model):
    yield from ((mode, lambda p, b, o=o: _jdp_step(model, p, b, o))
                for mode, o in JDP_MODES.items())
    yield "hand-written per-layer", lambda p, b: _hand_step(model, p, b, per_layer=True)


def measure(width: int, steps: int = 2, rounds: int = 2) -> dict:
    """{form: {layers: {mode: figures}}}: each mode timed alternately with the whole-model
    FSDP step (the baseline), its speed ratio the median over rounds of baseline / mode."""
    out = {}
    for form, model, layers in (("scan", _scanned, LAYERS), ("unrolled", _unrolled, (16,))):
        for n_layers in layers:
            params, batch = _data(n_layers, width)
            base = _hand_step(model, params, batch, per_layer=False)
            row = {}
            for mode, build in _builders(model):
                b = build(params, batch)
                ms, speed = _paired(base, b, steps, rounds)
                row[mode] = {"peak": b["peak"], "rest": b["rest"], "ms": ms, "speed": speed,
                             "params": n_layers * width * width}
                del b
                gc.collect()
            row["FSDP gathering the whole model (before)"] = {
                "peak": base["peak"], "rest": base["rest"], "ms": _ms(base, steps), "speed": 1.0,
                "params": n_layers * width * width}
            out.setdefault(form, {})[n_layers] = row
    return {"deep": out, "nodes": measure_nodes(width, steps=steps, rounds=rounds)}


def _paired(base: dict, b: dict, steps: int, rounds: int) -> tuple[float, float]:
    """`b`'s ms per step in the last round, and the median over `rounds` of base's time / b's,
    the two timed alternately (which goes first swaps each round)."""
    ratios = []
    for r in range(rounds):
        pair = [base, b] if r % 2 == 0 else [b, base]
        ms = {id(x): _ms(x, steps) for x in pair}
        ratios.append(ms[id(base)] / ms[id(b)])
    return ms[id(b)], statistics.median(ratios)


NODE_MODES = {"replicated": {}, "ZeRO": {"shard_optimizer": True},
              "FSDP": {"shard_params": True}, "HSDP (groups of 4)": {"shard_params": 4}}


def measure_nodes(width: int, layers: int = 16, steps: int = 2, rounds: int = 2) -> dict:
    """The 8 devices seen as 2 nodes of 4: each mode's peak, the bytes of its compiled
    collectives whose device groups span both nodes, and its speed against FSDP's step
    (alternated in one process)."""
    params, batch = _data(layers, width)
    base, out = _jdp_step(_scanned, params, batch, NODE_MODES["FSDP"]), {}
    for mode, options in NODE_MODES.items():
        b = base if mode == "FSDP" else _jdp_step(_scanned, params, batch, options)
        text = b["run"].lower(*b["args"]).compile().as_text()
        ms, speed = _paired(base, b, steps, rounds)
        out[mode] = {"peak": b["peak"], "rest": b["rest"], "ms": ms, "speed": speed,
                     "crossing": hlo.crossing_bytes(text, jax.device_count() // 2)}
        gc.collect()
    return out


HEADER = ["layers", "form", "mode", "params + Adam at rest MiB", "step peak MiB",
          "ms / step", "speed vs whole-model FSDP", f"largest model in {BUDGET // 2**30} GiB, "
          "M params (at peak)"]


def table(r: dict) -> str:
    """The deep models' table, from one 8-device process: width 512 in the full run, 256 in
    the quick one (`zero_params` of 3M), none for a smaller `zero_params` (the smoke tests)."""
    size = r["settings"].get("zero_params", 0)
    if size < 1_000_000:
        return "Deep models: not measured (`zero_params` under 1M).\n"
    width = 512 if size >= 10_000_000 else 256
    proc = subprocess.run([sys.executable, "-m", "benchmarks.fsdp_layers", str(width)],
                          cwd=jobs.REPO, text=True, capture_output=True, timeout=3000,
                          env=jobs.base_env("default", XLA_FLAGS=jobs.device_flags(8)))
    if proc.returncode:
        return f"Deep models: failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}\n"
    rows, found = [], json.loads(proc.stdout.splitlines()[-1])
    for form, sizes in found["deep"].items():
        for layers, modes in sizes.items():
            for mode, f in modes.items():
                rows.append([layers, form, mode, report.fmt(f["rest"] / MiB, 1),
                             report.fmt(f["peak"] / MiB, 1), report.fmt(f["ms"], 0),
                             report.fmt(f["speed"]),
                             report.fmt(BUDGET / (f["peak"] / f["params"]) / 1e6, 0)])
    note = (f"Deep MLPs, width {width}, Adam, {PER_DEVICE} examples per device, 8 devices; "
            "layers stacked and scanned (each under `jax.checkpoint`), or unrolled. Peak: "
            "`memory_analysis()` of the compiled step. Speed: the whole-model FSDP step's time / "
            "this mode's, alternated in one process. Largest model: 2 GiB / measured bytes per "
            "parameter at peak (computed, not tried).\n\n")
    return note + report.table(HEADER, rows) + _nodes_table(found["nodes"], width)


def _nodes_table(found: dict, width: int) -> str:
    """HSDP against the other modes on 2 simulated nodes of 4 devices."""
    rows = [[mode, report.fmt(f["rest"] / MiB, 1), report.fmt(f["peak"] / MiB, 1),
             report.fmt(f["crossing"] / MiB, 2), report.fmt(f["ms"], 0), report.fmt(f["speed"])]
            for mode, f in found.items()]
    return (f"\n\n**Two nodes of 4 devices** (the 8 devices as 2 nodes; 16 scanned layers of "
            f"{width}, Adam): bytes crossing nodes = result bytes of the compiled collectives "
            "whose device groups span both nodes, per device per step.\n\n" + report.table(
                ["mode", "at rest MiB", "step peak MiB", "MiB crossing nodes", "ms / step",
                 "speed vs FSDP"], rows))


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]))))
