"""Runs flax's linen MNIST example (`train.py` here, ported to jdp) as flax's `main.py` does.

flax's `main.py` reads its configuration through absl flags and needs TensorFlow and clu; this
one takes the same hyperparameters (flax's `configs/default.py`: learning rate 0.1, momentum
0.9, batch 128, 10 epochs) from the command line:

    python examples/flax_mnist/main.py --workdir /tmp/mnist                # all local devices
    python -m jdp.launch --nproc_per_node 2 examples/flax_mnist/main.py --workdir /tmp/mnist

`--train` names another copy of the example to run (tests/system/examples/test_flax_ports.py runs
flax's own on one device this way).
"""
from __future__ import annotations

import argparse
import importlib.util
import os

if __name__ == "__main__":  # simulated CPU devices, set before jax starts; GPUs ignore it
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import ml_collections
from absl import logging


def get_config(args: argparse.Namespace) -> ml_collections.ConfigDict:
    """flax's default configuration, with the values given on the command line."""
    config = ml_collections.ConfigDict()
    config.learning_rate = args.learning_rate
    config.momentum = args.momentum
    config.batch_size = args.batch_size
    config.num_epochs = args.num_epochs
    return config


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/flax_mnist")
    parser.add_argument("--learning_rate", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--num_epochs", type=int, default=10)
    parser.add_argument("--train", default=os.path.join(here, "train.py"))
    args = parser.parse_args()
    logging.set_verbosity(logging.INFO)
    spec = importlib.util.spec_from_file_location("train", args.train)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    train.train_and_evaluate(get_config(args), args.workdir)


if __name__ == "__main__":
    main()
