"""A replica group's script whose set-up the tests vary: the example's model and data
(`examples/fault_tolerant.py`) with another optimizer, layout, batch size, sampler or
`jdp.ft.Replicas` limits, its loop in either form (`--train`: one call). Run as a script, one
process per group process."""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "examples"))

import fault_tolerant as example  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jdp  # noqa: E402
import jdp.ft  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    p.add_argument("--shard_params", type=int, default=0)
    p.add_argument("--plain_sampler", action="store_true",
                   help="jdp.data.DistributedSampler's defaults instead of jdp.ft.sampler")
    p.add_argument("--start_timeout", type=float, default=300.0)
    p.add_argument("--quorum_timeout", type=float, default=60.0)
    p.add_argument("--min_groups", type=int, default=None)
    p.add_argument("--step_time", type=float, default=0.0)
    p.add_argument("--init_shift", type=float, default=0.0,
                   help="added to every initial parameter (a group that initialised apart)")
    p.add_argument("--sync_every", type=int, default=None)
    p.add_argument("--diloco", action="store_true", help="with --sync_every: outer SGD(0.7)")
    p.add_argument("--out", default=None, help="the final parameters (.npz, process 0)")
    p.add_argument("--train", action="store_true",
                   help="the loop in one call, replicas.train (default: train_step in batches)")
    return p.parse_args()


def one_call(replicas, state, args, layout) -> None:
    """`replicas.train`, each attempt paced to last `--step_time` at least."""
    began = time.perf_counter()
    for _ in replicas.train(example.loss_fn, args.steps, **layout):
        time.sleep(max(0.0, args.step_time - (time.perf_counter() - began)))
        began = time.perf_counter()


def step_by_step(replicas, state, args, layout) -> None:
    """`replicas.train_step`'s step called in `replicas.batches`' loop, each step paced."""
    step = replicas.train_step(example.loss_fn, **layout)
    for batch in replicas.batches(args.steps):
        began = time.perf_counter()
        state, _ = step(state, batch)
        time.sleep(max(0.0, args.step_time - (time.perf_counter() - began)))


def main() -> None:
    args = parse_args()
    jdp.initialize()
    data = example.dataset()
    sampler = (jdp.data.DistributedSampler(example.EXAMPLES, seed=0) if args.plain_sampler
               else jdp.ft.sampler(example.EXAMPLES, seed=0))
    loader = jdp.data.Loader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    tx = optax.adam(0.01) if args.optimizer == "adam" else optax.sgd(0.01)
    layout = {"shard_params": args.shard_params or False}
    params = jax.tree.map(lambda x: x + args.init_shift, example.init_params(args.width))
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=tx), **layout)
    with jdp.ft.Replicas(state, loader, start_timeout=args.start_timeout,
                         quorum_timeout=args.quorum_timeout,
                         min_groups=args.min_groups, sync_every=args.sync_every,
                         outer=optax.sgd(0.7) if args.diloco else None) as replicas:
        (one_call if args.train else step_by_step)(replicas, state, args, layout)
        state = replicas.state
    final = jax.tree.map(np.asarray, jdp.unshard(state.params))
    if args.out and jax.process_index() == 0:
        np.savez(args.out, **final)
    jdp.print0(f"FINISHED at step {replicas.step}")


if __name__ == "__main__":
    main()
