"""A Fashion-MNIST-style MLP, started with `jdp.spawn` over 2 processes.

What PyTorch users write as `mp.spawn(main, args=(world_size,), nprocs=world_size)`: each
process runs `main(rank, ...)` with `jdp.initialize()` already done. 784→200→200→10 with
sigmoid activations and log-softmax, Adam lr 0.01, 100 examples per process per step.

    python examples/spawn_mlp.py                          # real MNIST digits (mnist5k), 2 processes
    python examples/spawn_mlp.py --dataset fashion_mnist --data-dir ~/tfds
"""
from __future__ import annotations

import argparse

import example_data  # the examples' data, a sibling module
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdp


class MLP(nn.Module):
    """784 → 200 → 200 → 10, sigmoid hidden layers, log-softmax output."""

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1).astype(jnp.float32) / 255.0
        x = nn.sigmoid(nn.Dense(200)(x))
        x = nn.sigmoid(nn.Dense(200)(x))
        return nn.log_softmax(nn.Dense(10)(x))


def nll_loss(params, batch):
    """Negative log-likelihood of the log-softmax outputs, mean over the device's examples."""
    log_probs = MLP().apply({"params": params}, batch["image"])
    return -jnp.take_along_axis(log_probs, batch["label"][:, None], axis=1).mean()


def main(rank: int, args: argparse.Namespace) -> None:
    """One process's training loop; `rank` is this process's index, as in `mp.spawn`."""
    source = example_data.load(args.dataset, "train", data_dir=args.data_dir)
    sampler = jdp.data.DistributedSampler(len(source), shuffle=True, seed=args.seed)
    loader = jdp.data.Loader(source, args.batch_size, sampler=sampler, drop_last=True)
    init = jax.jit(MLP().init)   # one compiled program, not one per initializer's op
    params = init(jax.random.key(args.seed), np.zeros((1, 28, 28, 1), np.uint8))["params"]
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params,
                                                tx=optax.adam(args.lr)))
    step = jdp.train_step(nll_loss)
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        losses = []
        for batch in loader:
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        losses = [float(x) for x in losses]
        if rank == 0:
            print(f"epoch {epoch}: mean loss {np.mean(losses):.4f} (first batch {losses[0]:.4f}, "
                  f"last batch {losses[-1]:.4f})", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="mnist5k",
                   choices=["mnist5k", "digits", "mnist", "fashion_mnist"])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=100, help="per process")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nprocs", type=int, default=2)
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    jdp.spawn(main, args=(arguments,), nprocs=arguments.nprocs, devices_per_process=1)
