"""A loss and a state that disagree on `rng` fail with an error naming the fix (`seed=` on
one side, the loss's `rng` parameter on the other), in the global and the pmap form."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp

N = 8


def batch():
    return {"x": np.ones((N, 2), np.float32), "y": np.ones((N, 1), np.float32)}


def plain_loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def rng_loss(params, batch, rng):
    keep = jax.random.bernoulli(rng, 0.9, batch["x"].shape)   # dropout on the inputs
    return jnp.mean(((batch["x"] * keep) @ params["w"] - batch["y"]) ** 2)


def state(seed):
    return jdp.TrainState.create(apply_fn=None, params={"w": np.zeros((2, 1), np.float32)},
                                 tx=optax.sgd(0.1), seed=seed)


@pytest.mark.parametrize("form", ["global", "pmap"])
def test_seed_with_a_loss_without_rng_names_the_rng_parameter_and_seed(form):
    with pytest.raises(TypeError, match=r"plain_loss\(params, batch\) takes no rng: add an "
                                        r"`rng` parameter.*without seed="):
        run(form, plain_loss, state(seed=0))


@pytest.mark.parametrize("form", ["global", "pmap"])
def test_a_loss_taking_rng_without_seed_names_seed(form):
    with pytest.raises(TypeError, match=r"rng_loss\(params, batch, rng\) takes rng.*"
                                        r"TrainState.create\(\.\.\., seed=0\)"):
        run(form, rng_loss, state(seed=None))


def test_agreeing_loss_and_state_train():
    new, metrics = run("global", rng_loss, state(seed=0))
    assert np.isfinite(float(metrics["loss"])) and int(new.step) == 1


def run(form, loss_fn, s):
    if form == "global":
        return jdp.train_step(loss_fn)(jdp.broadcast(s), jdp.shard(batch()))
    return jdp.pmap.train_step(loss_fn)(jdp.pmap.replicate(s), jdp.pmap.shard(batch()))
