"""A bare cross-process all-reduce right after the ranks slept, and right after they were busy.

    python -m jdp.launch --nproc_per_node 2 --devices_per_process 1 -m benchmarks.allreduce jax
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m benchmarks.allreduce torch

Each rank prints the median milliseconds of an all-reduce of BYTES (the seed CNN's gradient) in
16 alternated rounds: right after a barrier, after 100 ms asleep, and after a 100 ms busy loop
(what a training step's compute is to the all-reduce that follows it). docs/performance.md
says what the difference means; BENCHMARKS.md holds the runs.
"""
from __future__ import annotations

import statistics
import sys
import time

BYTES = 1_720_000
ROUNDS = 16


def _measure(all_reduce, barrier) -> dict:
    """Median ms of `all_reduce()` at once, after sleeping and after spinning 100 ms."""
    res: dict = {"at once": [], "after sleep": [], "after busy": []}
    for i in range(ROUNDS):
        for mode in list(res)[:: 1 if i % 2 == 0 else -1]:
            barrier(f"allreduce{i}{mode}")
            end = time.perf_counter() + 0.1
            if mode == "after busy":
                while time.perf_counter() < end:
                    pass
            elif mode == "after sleep":
                time.sleep(0.1)
            start = time.perf_counter()
            all_reduce()
            res[mode].append(time.perf_counter() - start)
    return {k: round(1e3 * statistics.median(v), 2) for k, v in res.items()}


def main_jax() -> None:
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import jdp
    jdp.initialize()
    psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, jdp.AXIS), mesh=jdp.mesh(),
                                 in_specs=P(jdp.AXIS), out_specs=P(jdp.AXIS)))
    x = jdp.shard(np.ones((jax.local_device_count(), BYTES // 4), np.float32))
    psum(x).block_until_ready()
    out = _measure(lambda: psum(x).block_until_ready(), jdp.barrier)
    print(f"jax rank {jax.process_index()}: all-reduce of {BYTES:,} bytes, ms: {out}", flush=True)


def main_torch() -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    x = torch.ones(BYTES // 4)
    dist.all_reduce(x)
    out = _measure(lambda: dist.all_reduce(x), lambda name: dist.barrier())
    print(f"torch rank {dist.get_rank()}: all-reduce of {BYTES:,} bytes, ms: {out}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    {"jax": main_jax, "torch": main_torch}[sys.argv[1]]()
