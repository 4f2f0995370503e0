"""The heal benchmark's replica group: a large state with a cheap step, so that a kill and the
heal that follows measure the state's transfer, not the model.

    python -m jdp.launch --nproc_per_node 1 --devices_per_process 2 --max_restarts 2 \\
        --replica_group G --replica_groups 3 --ft_lighthouse ... -m benchmarks.ft_heal \\
        --params 50000000 --steps 1000000

The state: `--params` float32 parameters in `LEAVES` equal vectors (replicated on the group's
2 devices), SGD (no optimizer state), the step counter. The loss reads 8 entries of each
leaf, so the step's compute is trivial; its gradient is still one float per parameter, which
the groups sum every step (jdp.ft exchanges whole gradients).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdp
import jdp.ft

LEAVES, EXAMPLES = 4, 1024


def loss_fn(params, batch):
    return sum(jnp.mean(w[:8] * batch["x"]) for w in params.values())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=50_000_000)
    p.add_argument("--steps", type=int, default=1_000_000)
    args = p.parse_args(argv)
    jdp.initialize()
    size = args.params // LEAVES
    params = {f"w{i}": np.full(size, 0.01 * (i + 1), np.float32) for i in range(LEAVES)}
    data = {"x": np.random.default_rng(0).normal(size=(EXAMPLES, 8)).astype(np.float32)}
    loader = jdp.data.Loader(data, batch_size=8, sampler=jdp.ft.sampler(EXAMPLES, seed=0),
                             drop_last=True)
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params,
                                                tx=optax.sgd(1e-3)))
    with jdp.ft.Replicas(state, loader) as replicas:
        step = replicas.train_step(loss_fn)
        for batch in replicas.batches(args.steps):
            state, _ = step(state, batch)
    jax.block_until_ready(replicas.state)


if __name__ == "__main__":
    main()
