"""What jdp's progress records cost a training step: the same loop with them and without.

Every train step records its phase and step into the rank's progress slot (and the Loader
one "data" record per batch): struct writes into a memory-mapped file, read by the launcher's
watchdog and goodput ledger. This measures (1) `record()` alone, per call, and (2) a real
loop, `jdp.train_step` of a small MLP over a `jdp.Loader` on this process's devices, timed
per step with records on (a slot file, as under `jdp.launch`) and off (no slot), in
alternated rounds in one process. Run: `python -m benchmarks.bench_progress`.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

from benchmarks.harness import report


def _slot_on(path: str) -> None:
    from jdp.job import progress as _progress
    from jdp.job import rank
    with open(path, "wb") as f:
        f.write(bytes(_progress.SLOT_SIZE))
    os.environ["JDP_PROGRESS_FILE"] = path
    rank.current().progress.slot = None   # mapped again at the next record


def _slot_off() -> None:
    from jdp.job import rank
    os.environ.pop("JDP_PROGRESS_FILE", None)
    rank.current().progress.slot = False   # as in a process without a supervisor


def record_cost(path: str, calls: int = 200_000) -> float:
    """Seconds per `record("step", k)` call into a slot file."""
    from jdp.job import rank
    _slot_on(path)
    start = time.perf_counter()
    for k in range(calls):
        rank.record("step", k)
    return (time.perf_counter() - start) / calls


def _loop(steps: int, width: int):
    """A train step and a loader of `steps` batches; returns run() -> seconds per step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jdp
    params = {"w1": jnp.zeros((width, width)), "w2": jnp.zeros((width, 1))}
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params,
                                                tx=optax.sgd(0.01)))
    step = jdp.train_step(lambda p, b: jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]) ** 2))
    rows = 16 * jax.device_count()
    data = {"x": np.ones((steps * rows, width), np.float32)}
    held = [state]

    def run() -> float:
        loader = jdp.Loader(data, rows, layout="global")
        s = held[0]
        start = time.perf_counter()
        for batch in loader:
            s, _ = step(s, batch)
        jax.block_until_ready(s)
        held[0] = s
        return (time.perf_counter() - start) / len(loader)

    return run


def measure(rounds: int = 10, steps: int = 200, width: int = 256) -> dict:
    """{"record_s": per call, "on"/"off": seconds per step of each alternated round}."""
    import jax
    with tempfile.TemporaryDirectory(prefix="jdp-bench-progress-") as tmp:
        path = os.path.join(tmp, "slot")
        cost = record_cost(path)
        run = _loop(steps, width)
        run()                                           # compile, warm the loader
        times: dict = {"on": [], "off": []}
        for r in range(rounds):
            for mode in ("on", "off")[:: 1 if r % 2 else -1]:
                _slot_on(path) if mode == "on" else _slot_off()
                times[mode].append(run())
        _slot_off()
    return {"record_s": cost, "devices": jax.device_count(), "steps": steps, **times}


def table(rounds: int = 10, steps: int = 200) -> str:
    """The markdown table: record() per call; a step's time with and without records."""
    r = measure(rounds, steps)
    on, off = statistics.median(r["on"]), statistics.median(r["off"])
    per_step = 2 * r["record_s"]                        # the step's record and the Loader's
    rows = [["record() alone, per call", f"{r['record_s'] * 1e6:.2f} µs", ""],
            ["records per step (train step + Loader: 2 calls)", f"{per_step * 1e6:.2f} µs",
             f"{100 * per_step / off:.3f} % of a step"],
            ["step with records (median)", f"{on * 1e3:.3f} ms", _spread_ms(r["on"])],
            ["step without records (median)", f"{off * 1e3:.3f} ms", _spread_ms(r["off"])],
            ["difference", f"{(on - off) * 1e6:+.1f} µs", f"{100 * (on - off) / off:+.2f} %"]]
    return (f"Progress records (watchdog, goodput, stragglers): `jdp.train_step` of a small MLP "
            f"over a `jdp.Loader` on {r['devices']} devices, {r['steps']} steps per round, "
            f"{rounds} rounds alternated with and without a progress slot; {os.cpu_count()} "
            "CPU cores. A difference of medians within the rounds' min-max is the loop's "
            "noise, not the records' cost (the per-call row)\n\n"
            + report.table(["", "time", "share / rounds min-max"], rows))


def _spread_ms(values: list) -> str:
    return f"{min(values) * 1e3:.3f}-{max(values) * 1e3:.3f} ms"


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    print(table())
