"""Loader throughput against the train step's consumption rate.

The input pipeline must never be what a training run waits for: `jdp.data.Loader` should
deliver batches (sampled, gathered, split per device, placed on the devices) much faster than
the train step consumes them. The loader figure comes from `benchmarks.bench_loader`
(`loader_throughput`, owned by the data module's authors), measured inside the same
1-process x 2-device worker and the same rounds as the train step it is compared with, at the
same per-process batch.
"""
from __future__ import annotations


def measure(request: dict) -> dict:
    """One run of `bench_loader.loader_throughput`: {"samples_per_s": ...}."""
    from benchmarks.bench_loader import loader_throughput

    rate = loader_throughput(batch_size=request["batch_size"],
                             num_batches=request["num_batches"], runs=1)
    return {"samples_per_s": rate}


def available() -> str | None:
    """None if the loader benchmark can run here, else why not."""
    import importlib.util

    if importlib.util.find_spec("jdp.data") is None:
        return "jdp.data is not there yet"
    if importlib.util.find_spec("benchmarks.bench_loader") is None:
        return "benchmarks/bench_loader.py is not there yet"
    return None
