"""FSDP's step never peaks above the compiler's own placement of the gathers: a small conv net,
whose per-layer gathers would peak about 5x higher, keeps the compiler's (and says so, with
both figures); a deep MLP keeps its per-layer gathers (lower), silently; both train as the
replicated step."""
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from jdp.core import _placement

N = 8


class Block(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Conv(self.channels, (3, 3))(x)) + x


class ConvNet(nn.Module):   # small kernels beside large activations
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3))(x)
        for _ in range(3):
            x = Block(8)(x)
        return nn.Dense(10)(jnp.mean(x, (1, 2)))


def conv_case():
    model = ConvNet()
    params = model.init(jax.random.key(0), np.zeros((1, 32, 32, 3), np.float32))
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(N * 4, 32, 32, 3)).astype(np.float32),
             "y": rng.integers(0, 10, N * 4).astype(np.int32)}

    def loss(p, b):
        logits = model.apply(p, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
    return loss, params, batch


class MLP(nn.Module):   # deep, layers large beside their activations
    @nn.compact
    def __call__(self, x):
        for _ in range(16):
            x = jnp.tanh(nn.Dense(256, use_bias=False)(x))
        return x


def mlp_case():
    model = MLP()
    params = model.init(jax.random.key(1), np.zeros((1, 256), np.float32))
    rng = np.random.default_rng(1)
    batch = {"x": rng.normal(size=(N * 2, 256)).astype(np.float32),
             "y": rng.normal(size=(N * 2, 256)).astype(np.float32)}

    def loss(p, b):
        return jnp.mean((model.apply(p, b["x"]) - b["y"]) ** 2)
    return loss, params, batch


def compiled_peak(loss, params, batch, **options):
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params,
                                                tx=optax.sgd(0.1)), **options)
    step = jdp.train_step(loss, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peak = _placement.peak(step.lower(state, jdp.shard(batch)).compile())
    said = [str(w.message) for w in caught if "peak at" in str(w.message)]
    new, _ = step(state, jdp.shard(batch))
    return peak, said, jax.device_get(jdp.unshard(new).params)


@pytest.mark.parametrize("case, keeps", [
    pytest.param(conv_case, "compiler", marks=pytest.mark.long), (mlp_case, "layers")])
def test_the_lower_peak_of_per_layer_and_the_compilers_gathers_is_kept(case, keeps):
    loss, params, batch = case()
    peak, said, trained = compiled_peak(loss, params, batch, shard_params=True)
    compiler, _, _ = compiled_peak(jdp.layer_policy(loss, enabled=False), params, batch,
                                   shard_params=True)
    _, _, replicated = compiled_peak(loss, params, batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), trained,
                 replicated)
    if keeps == "compiler":
        assert peak == compiler and len(said) == 1, (peak, compiler, said)
        layers, chosen = (float(x) for x in re.findall(r"at ([\d.]+) MiB", said[0]))
        assert chosen == pytest.approx(compiler / 2**20, abs=0.06) and layers > 2 * chosen, said
        assert "jdp.layer_policy(loss_fn, enabled=False)" in said[0]
    else:
        assert peak < compiler and not said, (peak, compiler, said)
