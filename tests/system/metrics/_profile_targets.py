"""What tests of `--profile_steps` hand to `jdp.spawn`: module-level, so ranks can import it."""


def train(rank: int, steps: int) -> None:
    """`steps` jdp train steps of a tiny linear model on every rank."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jdp
    state = jdp.broadcast(jdp.TrainState.create(
        apply_fn=None, params={"w": jnp.zeros((16, 16))}, tx=optax.sgd(0.01)))
    step = jdp.train_step(lambda p, b: jnp.mean((b["x"] @ p["w"] - 1.0) ** 2))
    for _ in range(steps):
        state, _ = step(state, jdp.shard({"x": np.ones((4, 16), np.float32)}))
    jax.block_until_ready(state)
