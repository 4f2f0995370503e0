"""The MNIST example on Ray Train: `JaxTrainer` starts the workers, jdp joins them as one job.

The training loop is examples/mnist.py, unchanged: its `jdp.initialize()` reads each worker's
rank, the worker count and process 0's address from Ray Train's context (no mapping here). On
CPU Ray's JAX backend sets nothing up; with `--gpu`, Ray initialises JAX itself and jdp joins
that job. A worker that dies ends `fit()` with an error (Ray names the lost worker; the
survivors name it in their logs). Needs `pip install "jdp[ray]"`.

    python examples/ray_train.py --workers 2 -- --epochs 3        # a local Ray cluster, CPU
    python examples/ray_train.py --address auto --workers 8 --gpu -- --epochs 10
"""
from __future__ import annotations

import argparse
import os

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.v2.jax import JaxTrainer

EXAMPLES = os.path.dirname(os.path.abspath(__file__))


def train_loop(config: dict) -> None:
    """One Ray Train worker: the MNIST example's main, with its own arguments."""
    import mnist  # from Ray's working_dir, this folder

    mnist.main(config["argv"])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=2, help="Ray Train workers (processes)")
    p.add_argument("--gpu", action="store_true", help="one GPU per worker")
    p.add_argument("--address", default=None, help="a running Ray cluster (default: start one)")
    p.add_argument("--storage", default=os.path.abspath("ray_results"), help="Ray's run dir")
    p.add_argument("mnist_args", nargs="*", help="arguments of examples/mnist.py, after --")
    args = p.parse_args(argv)
    ray.init(address=args.address, include_dashboard=False,
             runtime_env={"working_dir": EXAMPLES,
                          "env_vars": {"JAX_PLATFORMS": "cuda" if args.gpu else "cpu"}})
    trainer = JaxTrainer(train_loop, train_loop_config={"argv": args.mnist_args + ["--quiet"]},
                         scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
                         run_config=RunConfig(name="jdp-mnist", storage_path=args.storage))
    trainer.fit()
    ray.shutdown()


if __name__ == "__main__":
    main()
