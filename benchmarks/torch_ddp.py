"""The peer: the same CNN under PyTorch DDP on CPU, one rank of a torchrun job.

    python -m torch.distributed.run --nproc_per_node 2 -m benchmarks.torch_ddp --control DIR

Each rank: 1 thread, gloo, `DistributedDataParallel` over the example's CNN (conv32-BN-relu-
pool, conv64-BN-relu-pool, dense128, dense10; BatchNorm momentum 0.1 = flax's 0.9), SGD with
momentum 0.9 at lr 0.05, per-rank batch 64 of uint8 images scaled in the forward pass as the
JAX model does. The loop is DDP's usual one (zero_grad, forward, backward with the gradient
all-reduce, step); the loss stays on each rank, as a DDP script that does not log every step.
Answers `{"op": "time", "steps": n}` requests through `benchmarks.protocol`.
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks import malloc, protocol


class CNN(nn.Module):
    """The example's CNN in PyTorch's usual form (NCHW, max_pool2d, BatchNorm2d)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32, momentum=0.1)
        self.conv2, self.bn2 = nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64, momentum=0.1)
        self.fc1, self.fc2 = nn.Linear(64 * 7 * 7, 128), nn.Linear(128, 10)

    def forward(self, images):
        x = images.float() / 255.0
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class Bench:
    """One rank's DDP model, optimiser and fixed batch."""

    def __init__(self, per_rank: int):
        torch.manual_seed(0)
        self.model = nn.parallel.DistributedDataParallel(CNN())
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        rng = np.random.default_rng(dist.get_rank())
        self.images = torch.from_numpy(rng.integers(0, 256, (per_rank, 1, 28, 28), dtype=np.uint8))
        self.labels = torch.from_numpy(rng.integers(0, 10, per_rank, dtype=np.int64))
        self.global_batch = per_rank * dist.get_world_size()
        self.steps(3)

    def steps(self, n: int) -> None:
        """`n` DDP steps: zero_grad, forward, backward (gradient all-reduce), SGD step."""
        for _ in range(n):
            self.opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(self.model(self.images), self.labels)
            loss.backward()
            self.opt.step()

    def time(self, request: dict) -> dict:
        """Seconds for `steps` steps after one untimed step that lines the ranks up."""
        self.steps(1)
        return protocol.timed(lambda: self.steps(request["steps"]), request["steps"],
                              self.global_batch)


def main(argv=None) -> None:
    """Tune the allocator if asked, join the gloo group, serve timing requests."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--control", required=True)
    p.add_argument("--per-rank", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--malloc", choices=["default", "tuned"], default="default")
    args = p.parse_args(argv)
    tuned = args.malloc == "tuned" and malloc.tune()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    bench = Bench(args.per_rank)
    info = {"processes": dist.get_world_size(), "threads": torch.get_num_threads(),
            "global_batch": bench.global_batch, "torch": torch.__version__,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "malloc_tuned": tuned}
    protocol.serve(args.control, {"time": bench.time}, primary=dist.get_rank() == 0, info=info)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
