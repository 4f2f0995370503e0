"""A rank of the engine tests: the README's loop, 1 epoch of 4 steps, every loss printed.

Started by test_engines.py (beside it) under each engine's environment; prints "LOSSES [...]" on
every process (the metrics are replicated), so a test compares the jobs' losses.
"""
import jax.numpy as jnp
import numpy as np
import optax

import jdp


def main(train=None):
    jdp.initialize()
    x = np.random.default_rng(0).standard_normal((64, 2)).astype(np.float32)
    source = {"x": x, "y": x @ np.array([[2.0], [-1.0]], np.float32)}

    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    state = jdp.TrainState.create(apply_fn=None, params={"w": jnp.zeros((2, 1))},
                                  tx=optax.sgd(0.1))
    state = jdp.broadcast(state)
    step = jdp.train_step(loss_fn)
    sampler = jdp.data.DistributedSampler(64, shuffle=True, seed=0)
    loader = jdp.data.Loader(source, batch_size=8, sampler=sampler, drop_last=True)
    losses = []
    for batch in loader:
        state, metrics = step(state, batch)
        losses.append(round(float(metrics["loss"]), 6))
    print(f"LOSSES {jdp.process_index()} {jdp.process_count()} {losses}", flush=True)
    return losses


if __name__ == "__main__":
    main()
