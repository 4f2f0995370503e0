"""Loader throughput: MNIST-shaped batches read, split and put on every local device.

The Loader must keep far ahead of the train step (the MNIST CNN step consumes ~3000-6000
samples/s here), so the target is >= 100k samples/s. Measured: a shuffled epoch of 60000
uint8 28x28x1 images and int32 labels, `batch_size` per process, each batch waited for on the
devices (`block_until_ready`), the prefetch thread's start included.

    python -m benchmarks.bench_loader            # 8 simulated CPU devices unless XLA_FLAGS says
"""
from __future__ import annotations

import itertools
import os
import statistics
import time

if __name__ == "__main__":  # before jax is imported: simulated devices, as `make bench` sets
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jdp  # noqa: E402

NUM_EXAMPLES = 60000


def mnist_like(seed: int = 0) -> dict[str, np.ndarray]:
    """Random data with MNIST's shapes and dtypes (60000 x 28 x 28 x 1 uint8, int32 labels)."""
    rng = np.random.default_rng(seed)
    return {"image": rng.integers(0, 256, (NUM_EXAMPLES, 28, 28, 1), dtype=np.uint8),
            "label": rng.integers(0, 10, NUM_EXAMPLES, dtype=np.int32)}


def loader_throughput(batch_size: int = 128, num_batches: int = 200, runs: int = 5) -> float:
    """Median samples/s over `runs` runs of `num_batches` batches through `jdp.data.Loader`.

    Args:
        batch_size: examples per batch on this process (a multiple of the local device count).
        num_batches: batches per run (at most one epoch: 60000 // batch_size).
        runs: runs to take the median of; each starts a new epoch (new permutation).

    Returns:
        Samples per second, device transfer included.

    Example:
        >>> rate = loader_throughput(batch_size=128, num_batches=200)
    """
    source = mnist_like()
    loader = jdp.data.Loader(source, batch_size, shuffle=True, seed=0, drop_last=True)
    num_batches = min(num_batches, len(loader))
    rates = []
    for run in range(runs):
        loader.set_epoch(run)
        start = time.perf_counter()
        for batch in itertools.islice(loader, num_batches):
            jax.block_until_ready(batch)
        rates.append(num_batches * batch_size / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    rate = loader_throughput()
    print(f"loader: {rate:,.0f} samples/s (batch 128 over {jax.local_device_count()} "
          f"{jax.devices()[0].platform} devices, median of 5)")


if __name__ == "__main__":
    main()
