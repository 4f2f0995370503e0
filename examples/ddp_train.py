"""The DDP quickstart of the PyTorch / OneFlow docs, ported to jdp.

A linear model w (2x1, zeros) learns [2, 3] with SGD (lr 0.01, 500 iterations) on a sum-reduced
squared error. Each replica is fed its own two examples, chosen by its global index, and the
gradients are averaged across replicas, so every rank ends with the same w.

    python -m jdp.launch --nproc_per_node 2 examples/ddp_train.py   # 2 ranks, as in the docs
    python examples/ddp_train.py                                    # 1 process, all local devices
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdp

# The two ranks' data of the original; replica g takes pair g % 2.
PAIRS = [
    (np.array([[1, 2], [2, 3]], np.float32), np.array([[8], [13]], np.float32)),
    (np.array([[4, 6], [3, 1]], np.float32), np.array([[26], [9]], np.float32)),
]


def local_batch() -> dict:
    """This process's examples, one pair per local device: [2 * local_devices, ...]."""
    first = jax.process_index() * jax.local_device_count()
    pairs = [PAIRS[(first + d) % 2] for d in range(jax.local_device_count())]
    return {"x": np.concatenate([p[0] for p in pairs]), "y": np.concatenate([p[1] for p in pairs])}


def loss_fn(params, batch):
    """Squared error with sum reduction, as `nn.MSELoss(reduction="sum")`."""
    return jnp.sum((batch["x"] @ params["w"] - batch["y"]) ** 2)


def main(iterations: int = 500) -> None:
    jdp.initialize()
    state = jdp.TrainState.create(apply_fn=None, params={"w": jnp.zeros((2, 1))},
                                  tx=optax.sgd(0.01))
    state = jdp.broadcast(state)                           # DDP(model): rank 0's w everywhere
    batch = jdp.shard(local_batch())                       # one global batch, 2 rows per device
    step = jdp.train_step(loss_fn)
    for i in range(iterations):
        state, metrics = step(state, batch)
        if i % 50 == 0:
            print(f"rank {jax.process_index()}: iteration {i} loss {float(metrics['loss']):.6f}")
    w = np.asarray(state.params["w"])
    print(f"rank {jax.process_index()}: final w = {w.tolist()}")


if __name__ == "__main__":
    main()
