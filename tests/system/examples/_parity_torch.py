"""Parity run, PyTorch side: the same CNN with DistributedDataParallel (gloo), torch's own
DistributedSampler and DataLoader.

    python -m torch.distributed.run --nproc_per_node 2 \
        tests/system/examples/_parity_torch.py DATA OUT STEPS

Same examples, same initial weights (DATA.npz, NHWC/HWIO as jdp uses, transposed here), same
order (unshuffled DistributedSampler), same SGD; writes the global loss of each step (rank 0).
"""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BATCH, LR, MOMENTUM = 32, 0.01, 0.9  # per process, as in _parity_jdp.py


class CNN(torch.nn.Module):
    def __init__(self, data):
        super().__init__()
        self.c1 = torch.nn.Conv2d(1, 32, 3, padding=1)
        self.c2 = torch.nn.Conv2d(32, 64, 3, padding=1)
        self.d1 = torch.nn.Linear(7 * 7 * 64, 128)
        self.d2 = torch.nn.Linear(128, 10)
        with torch.no_grad():
            for layer, name in ((self.c1, "c1"), (self.c2, "c2")):  # HWIO -> OIHW
                layer.weight.copy_(torch.from_numpy(data[name + "w"].transpose(3, 2, 0, 1)))
                layer.bias.copy_(torch.from_numpy(data[name + "b"]))
            for layer, name in ((self.d1, "d1"), (self.d2, "d2")):  # (in, out) -> (out, in)
                layer.weight.copy_(torch.from_numpy(data[name + "w"].T))
                layer.bias.copy_(torch.from_numpy(data[name + "b"]))

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        x = x.permute(0, 2, 3, 1).flatten(1)  # flatten in NHWC order, as jdp's reshape
        return self.d2(F.relu(self.d1(x)))


def main(data_path, out_path, steps):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    data = dict(np.load(data_path))
    model = DistributedDataParallel(CNN(data))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    images = torch.from_numpy(data["image"].transpose(0, 3, 1, 2).copy())
    dataset = TensorDataset(images, torch.from_numpy(data["label"].astype(np.int64)))
    loader = DataLoader(dataset, batch_size=BATCH, drop_last=True,
                        sampler=DistributedSampler(dataset, shuffle=False))
    losses = []
    for x, y in loader:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        if len(losses) == steps:
            break
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    # torch 2.13 + gloo: now and then, on a loaded machine, the interpreter's shutdown after
    # destroy_process_group() aborts in C++ ("terminate called without an active exception",
    # SIGABRT; about 1 run in 20 here with both cores busy). The work is done and written by
    # then, so leave without running the C++ destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
