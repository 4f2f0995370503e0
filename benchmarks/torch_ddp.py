"""The peer: the same CNN under PyTorch DDP on CPU, one rank of a torchrun job.

    python -m torch.distributed.run --nproc_per_node 2 -m benchmarks.torch_ddp CONTROL_DIR

Each rank: 1 thread, gloo, `DistributedDataParallel` over the example's CNN in PyTorch's usual
form (NCHW, max_pool2d; BatchNorm momentum 0.1 = flax's 0.9), SGD momentum 0.9 at lr 0.05, 64
uint8 images per rank scaled as the JAX model does, DDP's usual loop. Answers "time" requests.
"""
from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from benchmarks import harness

PER_RANK = 64


def cnn() -> nn.Module:
    """conv32-BN-relu-pool, conv64-BN-relu-pool, dense128, dense10."""
    def block(cin: int, cout: int) -> list:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout, momentum=0.1),
                nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*block(1, 32), *block(32, 64), nn.Flatten(), nn.Linear(64 * 7 * 7, 128),
                         nn.ReLU(), nn.Linear(128, 10))


def main(control: str) -> None:
    """Join the gloo group, build the model and a fixed batch, serve timing requests."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(cnn())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rng = np.random.default_rng(dist.get_rank())
    images = torch.from_numpy(rng.integers(0, 256, (PER_RANK, 1, 28, 28), dtype=np.uint8))
    labels = torch.from_numpy(rng.integers(0, 10, PER_RANK, dtype=np.int64))

    def steps(n: int) -> None:
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(images.float() / 255.0), labels).backward()
            opt.step()

    def time(request: dict) -> dict:  # after one untimed step that lines the ranks up
        steps(1)
        return harness.timed(lambda: steps(request["steps"]), request["steps"],
                             PER_RANK * dist.get_world_size())

    steps(3)
    harness.serve(control, {"time": time}, primary=dist.get_rank() == 0,
                  info={"variants": ["ddp"], "torch": torch.__version__})
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
