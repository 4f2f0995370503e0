"""Seconds per epoch: your own `jax.jit` step vs `jdp.train_step` vs one device.

Two models on the offline MNIST digits (4,000 training examples, global batch 128, 31 steps an
epoch): flax's linen MNIST example as ported in examples/flax_mnist/train.py (its own
`apply_model` + `update_model` jitted functions on `jdp.shard` batches) and the seed CNN of
examples/mnist.py (BatchNorm; its own step written around the example's `loss_fn`). Each is run
three ways, each in a process of its own: its own step on 1 device, its own step on 8
devices, and `jdp.train_step` on 8 devices. The first epoch (compilation) is not timed; the
median of the others is printed.

    python -m benchmarks.own_step [--epochs 4]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT_DIR = os.path.join(REPO, "examples", "flax_mnist")


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _linen_runners(jax, jdp, optax, np):
    """(own, jdp_step) epoch functions for flax's linen example, and its first state."""
    train = _load(os.path.join(PORT_DIR, "train.py"), "flax_linen_train")
    train_ds, _ = train.get_datasets()
    config = type("Config", (), {"learning_rate": 0.1, "momentum": 0.9})()
    state = jdp.broadcast(train.create_train_state(jax.random.key(0), config))

    def loss_fn(params, batch):
        logits = train.CNN().apply({"params": params}, batch["image"])
        one_hot = jax.nn.one_hot(batch["label"], 10)
        return optax.softmax_cross_entropy(logits=logits, labels=one_hot).mean()

    step = jdp.train_step(loss_fn, donate=False)

    def own(state, epoch):
        return train.train_epoch(state, train_ds, 128, jax.random.key(epoch))[0]

    def with_jdp(state, epoch):
        perms = np.asarray(jax.random.permutation(jax.random.key(epoch), 4000))[:3968]
        for perm in perms.reshape(31, 128):
            state, _ = step(state, jdp.shard({k: v[perm] for k, v in train_ds.items()}))
        return state

    return own, with_jdp, state


def _seed_runners(jax, jdp, optax, np):
    """(own, jdp_step) epoch functions for examples/mnist.py's CNN with BatchNorm."""
    mnist = _load(os.path.join(REPO, "examples", "mnist.py"), "seed_mnist")
    data = _load(os.path.join(REPO, "examples", "example_data.py"), "example_data")
    arrays = data.load("mnist5k", "train").arrays
    state = jdp.broadcast(mnist.create_train_state(0, 0.05, 100))

    @jax.jit
    def own_step(state, batch):
        def f(params):
            return mnist.loss_fn(params, batch, state.model_state)
        (loss, (_, stats)), grads = jax.value_and_grad(f, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads).replace(model_state=stats), loss

    step = jdp.train_step(mnist.loss_fn, has_aux=True, donate=False)

    def epoch_of(run_step):
        def run(state, epoch):
            order = np.random.default_rng(epoch).permutation(4000)[:3968]
            for rows in order.reshape(31, 128):
                state, _ = run_step(state, jdp.shard({k: v[rows] for k, v in arrays.items()}))
            jax.block_until_ready(state)
            return state
        return run

    return epoch_of(own_step), epoch_of(step), state


def worker(model: str, way: str, epochs: int) -> float:
    """Median seconds per epoch of `way` ("own" or "jdp") in this process."""
    import jax
    import numpy as np
    import optax

    import jdp
    runners = {"linen": _linen_runners, "seed": _seed_runners}[model]
    own, with_jdp, state = runners(jax, jdp, optax, np)
    run, seconds = {"own": own, "jdp": with_jdp}[way], []
    for epoch in range(epochs):
        start = time.perf_counter()
        state = jax.block_until_ready(run(state, epoch))
        if epoch:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "WAY"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.epochs)))
        return
    for model in ("linen", "seed"):
        row = {}
        for name, way, devices in (("1 device", "own", 1), ("own step, 8 devices", "own", 8),
                                   ("jdp.train_step, 8 devices", "jdp", 8)):
            env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                       JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
                       PYTHONPATH=os.pathsep.join([PORT_DIR, os.path.join(REPO, "examples"), REPO,
                                                   os.environ.get("PYTHONPATH", "")]))
            out = subprocess.run([sys.executable, "-m", "benchmarks.own_step", "--worker", model,
                                  way, "--epochs", str(args.epochs)], env=env,
                                 cwd=REPO, capture_output=True, text=True, timeout=1200)
            row[name] = json.loads(out.stdout.strip().splitlines()[-1]) if not out.returncode \
                else f"failed ({out.stderr.strip().splitlines()[-1][:80]})"
        print(model, json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
