"""Keep training through a failure: 3 replica groups on torchft (docs/faults.md).

A 2-layer MLP learns a noisy linear map. Each replica group is its own jdp job (here 1
process x 2 CPU devices); the groups sum their gradients once a step over torchft. Kill any
group's process and the others go on after one discarded step; its launcher restarts it and it
heals from a live peer. Needs the `ft` extra (pip install 'jdp[ft]').

    python -m jdp.launch --nproc_per_node 1 --devices_per_process 2 --max_restarts 5 \\
        --replica_group 0 --replica_groups 3 --ft_lighthouse start examples/fault_tolerant.py &
    python -m jdp.launch --nproc_per_node 1 --devices_per_process 2 --max_restarts 5 \\
        --replica_group 1 --replica_groups 3 --ft_lighthouse 127.0.0.1:29510 \\
        examples/fault_tolerant.py &
    python -m jdp.launch ... --replica_group 2 ...   # the same as group 1

With `--sync_every H` the groups sync every H steps instead (LocalSGD: parameters averaged;
with `--outer diloco`, DiLoCo: the averaged `anchor - params` applied by SGD with Nesterov
momentum; `--fragments F --overlap T`: Streaming DiLoCo, the model in F parts synced at
staggered steps, each sync overlapping T steps; docs/faults.md "Groups far apart").
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdp
import jdp.ft

EXAMPLES, FEATURES = 6144, 16


def dataset() -> dict:
    """The same examples on every group: y = x @ w + noise."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
    w = rng.normal(size=(FEATURES, 1)).astype(np.float32)
    y = (x @ w + 0.1 * rng.normal(size=(EXAMPLES, 1))).astype(np.float32)
    return {"x": x, "y": y}


def init_params(width: int) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (FEATURES, width)) / np.sqrt(FEATURES),
            "b1": jnp.zeros(width),
            "w2": jax.random.normal(k2, (width, 1)) / np.sqrt(width), "b2": jnp.zeros(1)}


def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] + params["b2"] - batch["y"]) ** 2)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch_size", type=int, default=16, help="per process")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--step_time", type=float, default=0.0,
                        help="seconds each step lasts at least (to watch a kill)")
    parser.add_argument("--shard_params", type=int, default=0,
                        help="FSDP within each group over this many devices (0: replicated)")
    parser.add_argument("--shard_optimizer", action="store_true", help="ZeRO within each group")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--task", choices=("linear", "mnist5k"), default="linear",
                        help="a noisy linear map, or examples/mnist.py's CNN with BatchNorm "
                             "on 4,000 real MNIST digits (the data extra), evaluated at the end")
    parser.add_argument("--sync_every", type=int, default=None,
                        help="steps each group takes alone between syncs (default: none)")
    parser.add_argument("--outer", choices=("localsgd", "diloco"), default="localsgd",
                        help="with --sync_every: average the parameters, or DiLoCo")
    parser.add_argument("--fragments", type=int, default=1,
                        help="with --sync_every: sync the model in this many parts, staggered")
    parser.add_argument("--overlap", type=int, default=0,
                        help="with --sync_every: steps each sync's all-reduce runs beside")
    parser.add_argument("--outer_lr", type=float, default=0.7)
    parser.add_argument("--outer_momentum", type=float, default=0.9,
                        help="Nesterov momentum of DiLoCo's outer SGD (0: plain SGD)")
    parser.add_argument("--out", default=None, help="write the final parameters here (.npz)")
    return parser.parse_args(argv)


def outer_optimizer(args):
    """DiLoCo's outer optimizer, or None (LocalSGD, or every step without --sync_every)."""
    if args.sync_every is None or args.outer == "localsgd":
        return None
    return optax.sgd(args.outer_lr, momentum=args.outer_momentum or None,
                     nesterov=bool(args.outer_momentum))


def task(args) -> tuple:
    """(train source, initial state, loss_fn, step options, the end's evaluation or None)."""
    tx = optax.adam(args.lr) if args.optimizer == "adam" else optax.sgd(args.lr)
    if args.task == "linear":
        state = jdp.TrainState.create(apply_fn=None, params=init_params(args.width), tx=tx)
        return jdp.data.ArraySource(dataset()), state, loss_fn, {}, None
    import example_data  # the examples' data and the MNIST CNN, sibling modules
    import mnist
    init = jax.jit(mnist.CNN().init, static_argnames="train")   # one program, not one per op
    variables = init(jax.random.key(0), jnp.zeros((1, 28, 28, 1), jnp.uint8), train=False)
    state = jdp.TrainState.create(apply_fn=mnist.CNN().apply, params=variables["params"],
                                  tx=tx, model_state=variables["batch_stats"])
    test = jdp.data.Loader(example_data.load("mnist5k", "test"), args.batch_size,
                           sampler=jdp.data.DistributedSampler(1000, shuffle=False))
    return (example_data.load("mnist5k", "train"), state, mnist.loss_fn, {"has_aux": True},
            lambda s: mnist.evaluate(jdp.eval_step(mnist.metric_fn), s, test))


def main(argv=None) -> None:
    args = parse_args(argv)
    jdp.initialize()
    source, state, loss, options, evaluate = task(args)
    loader = jdp.data.Loader(source, batch_size=args.batch_size,
                             sampler=jdp.ft.sampler(len(source), seed=0), drop_last=True)
    layout = {"shard_params": args.shard_params or False,
              "shard_optimizer": args.shard_optimizer}
    state = jdp.broadcast(state, **layout)
    streaming = {"fragments": args.fragments, "overlap": args.overlap} if args.sync_every else {}
    with jdp.ft.Replicas(state, loader, sync_every=args.sync_every, outer=outer_optimizer(args),
                         **streaming) as replicas:
        # The loop's two halves (`replicas.train` is the same loop in one call): here the
        # pacing times the step alone, as a model's compute would take, the quorum before it
        step = replicas.train_step(loss, **options, **layout)
        for batch in replicas.batches(args.steps):
            began = time.perf_counter()
            state, metrics = step(state, batch)
            done = replicas.inner_steps if args.sync_every else replicas.step
            if replicas.committed and done % 50 == 0:
                jdp.print0(f"step {done}: loss {float(metrics['loss']):.4f} with "
                           f"groups {replicas.groups}")
            time.sleep(max(0.0, args.step_time - (time.perf_counter() - began)))
        state = replicas.state
    params = jax.tree.map(np.asarray, jdp.unshard(state.params))   # every process: a gather
    if args.out and jax.process_index() == 0:
        np.savez(args.out, step=int(state.step), **params)
        jdp.print0(json.dumps({"final_step": int(state.step)}))
    if evaluate is not None:
        jdp.print0(json.dumps({"group": replicas.coords.group, **evaluate(state)}))


if __name__ == "__main__":
    main()
