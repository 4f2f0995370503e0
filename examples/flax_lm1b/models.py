"""A decoder-only Transformer language model in flax linen, laid out as flax's lm1b example's
`models.py` (`TransformerLM` over a `Decoder` of unrolled `EncoderDecoder1DBlock`s).

Written for jdp from the upstream example's structure, not copied from it: the same modules,
names, parameter shapes, masks, sinusoidal position table and defaults (6 layers of 512, 8
heads, MLP 2048, dropout 0.1), without the autoregressive-decoding cache and the logical
partitioning annotations (neither is used in training, and jdp shards by itself). The layers
are a Python loop, as upstream: the model FSDP must gather one layer at a time with no change
to it (tests/core/test_fsdp_unrolled.py, benchmarks/fsdp_unrolled.py).
"""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class TransformerConfig:
    """The model's hyperparameters (upstream's names and defaults)."""
    vocab_size: int
    output_vocab_size: int
    logits_via_embedding: bool = False
    dtype: Any = jnp.float32
    emb_dim: int = 512
    num_heads: int = 8
    num_layers: int = 6
    qkv_dim: int = 512
    mlp_dim: int = 2048
    max_len: int = 2048
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    deterministic: bool = False
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.normal(stddev=1e-6)


def shift_right(x: jnp.ndarray) -> jnp.ndarray:
    """The tokens moved one place right along the sequence, a 0 first (teacher forcing)."""
    return jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]


def sinusoidal_table(max_len: int, features: int) -> np.ndarray:
    """The fixed position table `[1, max_len, features]`: sines then cosines of geometric
    frequencies from 1 to 1/10000."""
    position = np.arange(max_len)[:, None]
    half = features // 2
    rates = np.exp(np.arange(half) * -np.log(10000.0) / (half - 1))
    table = np.zeros((max_len, features), np.float32)
    table[:, :half] = np.sin(position * rates)
    table[:, half:2 * half] = np.cos(position * rates)
    return table[None]


class AddPositionEmbs(nn.Module):
    """Adds the fixed sinusoidal position table to the embedded tokens."""
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        table = sinusoidal_table(self.config.max_len, inputs.shape[-1])
        return inputs + table[:, :inputs.shape[1]]


class MlpBlock(nn.Module):
    """Dense to `mlp_dim`, ReLU, dropout, Dense back, dropout."""
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        c = self.config
        x = nn.Dense(c.mlp_dim, dtype=c.dtype, kernel_init=c.kernel_init,
                     bias_init=c.bias_init)(inputs)
        x = nn.Dropout(rate=c.dropout_rate)(nn.relu(x), deterministic=c.deterministic)
        x = nn.Dense(inputs.shape[-1], dtype=c.dtype, kernel_init=c.kernel_init,
                     bias_init=c.bias_init)(x)
        return nn.Dropout(rate=c.dropout_rate)(x, deterministic=c.deterministic)


class EncoderDecoder1DBlock(nn.Module):
    """One pre-norm decoder layer: self-attention and an MLP, each with a residual."""
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None):
        c = self.config
        x = nn.LayerNorm(dtype=c.dtype)(inputs)
        x = nn.MultiHeadDotProductAttention(  # upstream's SelfAttention, now deprecated
            num_heads=c.num_heads, dtype=c.dtype, qkv_features=c.qkv_dim,
            kernel_init=c.kernel_init, bias_init=c.bias_init, use_bias=False,
            broadcast_dropout=False, dropout_rate=c.attention_dropout_rate,
            deterministic=c.deterministic, name="SelfAttention_0")(x, mask=decoder_mask)
        x = nn.Dropout(rate=c.dropout_rate)(x, deterministic=c.deterministic) + inputs
        z = MlpBlock(config=c)(nn.LayerNorm(dtype=c.dtype)(x))
        return x + z


class Decoder(nn.Module):
    """Token embedding, positions, the layers (a Python loop), a final norm, the logits."""
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None):
        c = self.config
        embed = nn.Embed(num_embeddings=c.output_vocab_size, features=c.emb_dim,
                         embedding_init=nn.initializers.normal(stddev=1.0))
        y = embed(shift_right(inputs.astype(jnp.int32)))
        y = AddPositionEmbs(config=c, name="posembed_output")(y)
        y = nn.Dropout(rate=c.dropout_rate)(y, deterministic=c.deterministic).astype(c.dtype)
        for i in range(c.num_layers):
            y = EncoderDecoder1DBlock(config=c, name=f"encoderdecoderblock_{i}")(
                y, decoder_mask=decoder_mask)
        y = nn.LayerNorm(dtype=c.dtype, name="encoderdecoder_norm")(y)
        if c.logits_via_embedding:
            return embed.attend(y.astype(jnp.float32)) / jnp.sqrt(y.shape[-1])
        return nn.Dense(c.output_vocab_size, dtype=c.dtype, kernel_init=c.kernel_init,
                        bias_init=c.bias_init, name="logitdense")(y)


def decoder_mask(inputs: jnp.ndarray, dtype: Any) -> jnp.ndarray:
    """Attention allowed between non-padding tokens (id > 0), from each to those before it."""
    return nn.combine_masks(nn.make_attention_mask(inputs > 0, inputs > 0, dtype=dtype),
                            nn.make_causal_mask(inputs, dtype=dtype))


class TransformerLM(nn.Module):
    """The language model: logits `[batch, length, output_vocab_size]` for token ids."""
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        mask = decoder_mask(inputs, self.config.dtype)
        logits = Decoder(config=self.config, name="decoder")(inputs, decoder_mask=mask)
        return logits.astype(self.config.dtype)
