"""The peer: the same CNN under PyTorch DDP on CPU, one rank of a torchrun job.

    python -m torch.distributed.run --nproc_per_node 2 -m benchmarks.torch_ddp CONTROL_DIR

Each rank: 1 thread, gloo, `DistributedDataParallel` over the example's CNN (BatchNorm momentum
0.1 = flax's 0.9), SGD momentum 0.9 at lr 0.05, 64 uint8 images per rank scaled in the forward
pass as the JAX model does; DDP's usual loop (zero_grad, forward, backward with the gradient
all-reduce, step). Answers "time" requests through `benchmarks.harness`.
"""
from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks import harness

PER_RANK = 64


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


def main(control: str) -> None:
    """Join the gloo group, build the model and a fixed batch, serve timing requests."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(CNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rng = np.random.default_rng(dist.get_rank())
    images = torch.from_numpy(rng.integers(0, 256, (PER_RANK, 1, 28, 28), dtype=np.uint8))
    labels = torch.from_numpy(rng.integers(0, 10, PER_RANK, dtype=np.int64))

    def steps(n: int) -> None:
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(images), labels).backward()
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
