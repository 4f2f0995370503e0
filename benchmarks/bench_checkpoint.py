"""How long `Checkpointer.save` blocks the training loop, synchronous and asynchronous.

The state: an MLP of three square layers (~50M parameters) with Adam, its optimizer state
ZeRO-sharded (`jdp.broadcast(state, shard_optimizer=True)`), on this process's devices (8
simulated ones under `make bench`). One synchronous and one `async_save=True` Checkpointer
save the same state in turn, each into its own directory; the first save of each is a warm-up
(the process's first save also compiles the checksum's device function: its own row).
"blocks" is `save()`'s wall time, what the training loop waits; "on disk" adds the wait for the
background write (`latest_step()` waits for it). Run: `python -m benchmarks.bench_checkpoint`.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

from benchmarks.harness import report

PARAMS = 50_000_000


def _state(params: int):
    """The ZeRO-sharded train state of a `params`-parameter MLP with Adam."""
    import jax
    import numpy as np
    import optax

    import jdp
    d = max(8, int((params / 3) ** 0.5) // 8 * 8)
    rng = np.random.default_rng(0)
    weights = {f"w{i}": rng.standard_normal((d, d), np.float32) / d ** 0.5 for i in range(3)}
    state = jdp.TrainState.create(apply_fn=None, params=weights, tx=optax.adam(1e-4))
    # Moments of a trained model: random, not Adam's zeros (which compress to nothing).
    state = state.replace(opt_state=jax.tree.map(
        lambda x: rng.standard_normal(x.shape, np.float32) * 1e-3 if x.ndim else x,
        state.opt_state))
    return jdp.broadcast(state, shard_optimizer=True), 3 * d * d


def measure(params: int = PARAMS, saves: int = 7) -> dict:
    """{"sync"|"async"|"async on disk": seconds of each timed save, saves alternated; "first":
    the process's first save}."""
    import jax

    import jdp
    state, count = _state(params)
    jax.block_until_ready(state)
    times: dict[str, list[float]] = {"sync": [], "async": [], "async on disk": [], "first": []}
    with tempfile.TemporaryDirectory(prefix="jdp-bench-ckpt-") as root:
        ckpts = {mode: jdp.checkpoint.Checkpointer(os.path.join(root, mode), max_to_keep=2,
                                                   async_save=mode == "async")
                 for mode in ("sync", "async")}
        for step in range(saves + 1):
            for mode in ("sync", "async")[:: 1 if step % 2 else -1]:
                start = time.perf_counter()
                ckpts[mode].save(step, state)
                returned = time.perf_counter()
                ckpts[mode].latest_step()  # waits for an asynchronous write
                if not step and not times["first"]:
                    times["first"].append(returned - start)
                if step:  # the first save of each creates its directory
                    times[mode].append(returned - start)
                    if mode == "async":
                        times["async on disk"].append(time.perf_counter() - start)
        for ckpt in ckpts.values():
            ckpt.close()
    return {"params": count, "devices": jax.device_count(), **times}


def table(params: int = PARAMS, saves: int = 7) -> str:
    """The markdown table: median seconds per save (min-max) over `saves` alternated saves."""
    r = measure(params, saves)
    rows = [[label, f"{statistics.median(r[key]):.3f}",
             f"{min(r[key]):.3f}-{max(r[key]):.3f}"] for label, key in [
        ("synchronous: save() blocks", "sync"), ("async_save=True: save() blocks", "async"),
        ("async_save=True: until on disk", "async on disk"),
        ("first save() of the process (async)", "first")]]
    return (f"Checkpointer.save of a {r['params']:,}-parameter MLP + Adam, optimizer state "
            f"ZeRO-sharded over {r['devices']} devices; median of {saves} alternated saves "
            f"(min-max); {os.cpu_count()} CPU cores\n\n"
            + report.table(["save", "seconds (median)", "min-max"], rows))


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    print(table())
