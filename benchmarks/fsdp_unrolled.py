"""FSDP on a Transformer whose layers are unrolled: lm1b's `TransformerLM` (examples/flax_lm1b/
models.py: 6 layers of 512, 8 heads, MLP 2048, vocabulary 256, 19.2M parameters), AdamW, 8
devices, `PER_DEVICE` sequences of `LENGTH` tokens per device, trained five ways: replicated,
ZeRO (`shard_optimizer`), FSDP with every gather left to the compiler (`jdp.layer_policy(...,
enabled=False)`: jdp's FSDP before it found the layers), FSDP gathering one layer at a time
(the default), and the same model with its layers under `nn.scan` (each under remat) under
FSDP. Per device: parameters + optimizer state at rest, the compiled step's peak
(`memory_analysis()`: arguments + outputs - aliased + temporaries), the all-gathers in the
compiled step (count, largest MiB), ms per step (median of `steps` after one untimed).
`python -m benchmarks.fsdp_unrolled [LAYERS WIDTH]` prints one JSON line (run it with 8
devices).
"""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdp
from benchmarks.harness import hlo, jobs, report

PER_DEVICE, LENGTH, VOCAB = 4, 128, 256
MiB = 2**20


def lm1b_models():
    """examples/flax_lm1b/models.py, loaded from its path (examples is not a package)."""
    path = os.path.join(jobs.REPO, "examples", "flax_lm1b", "models.py")
    spec = importlib.util.spec_from_file_location("lm1b_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scanned(models):
    """The same TransformerLM with its layers under `nn.scan`, each under remat."""
    import flax.linen as nn

    class ScanBlock(nn.Module):
        config: models.TransformerConfig

        @nn.compact
        def __call__(self, y, mask):
            return models.EncoderDecoder1DBlock(self.config)(y, mask), None

    class Decoder(nn.Module):
        config: models.TransformerConfig

        @nn.compact
        def __call__(self, inputs, mask):
            c = self.config
            y = nn.Embed(c.output_vocab_size, c.emb_dim,
                         embedding_init=nn.initializers.normal(1.0))(models.shift_right(inputs))
            y = models.AddPositionEmbs(config=c, name="posembed_output")(y)
            y = nn.scan(nn.remat(ScanBlock), variable_axes={"params": 0},
                        split_rngs={"params": True}, in_axes=nn.broadcast,
                        length=c.num_layers)(c)(y, mask)[0]
            y = nn.LayerNorm(name="encoderdecoder_norm")(y)
            return nn.Dense(c.output_vocab_size, kernel_init=c.kernel_init,
                            bias_init=c.bias_init, name="logitdense")(y)

    class LM(nn.Module):
        config: models.TransformerConfig

        @nn.compact
        def __call__(self, inputs):
            mask = models.decoder_mask(inputs, self.config.dtype)
            return Decoder(self.config, name="decoder")(inputs, mask)
    return LM


def _loss(net):
    def loss(params, batch):
        logits = net.apply({"params": params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"]).mean()
    return loss


def _build(net, loss, options: dict, batch) -> dict:
    placing = {k: v for k, v in options.items() if k.startswith("shard_")}
    params = net.init(jax.random.key(0), jnp.ones((1, LENGTH), jnp.int32))["params"]
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params,
                                                tx=optax.adamw(1e-4)), **placing)
    step = jdp.train_step(loss, **options)
    compiled = step.lower(state, batch).compile()
    m, text = compiled.memory_analysis(), compiled.as_text()
    gathers = [b for kind, b in hlo.each_collective(text) if kind == "all-gather"]
    return {"step": step, "state": state, "figures": {
        "params": sum(int(np.size(x)) for x in jax.tree.leaves(params)),
        "rest": sum(x.addressable_shards[0].data.nbytes
                    for x in jax.tree.leaves((state.params, state.opt_state))),
        "peak": (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                 + m.temp_size_in_bytes),
        "gathers": len(gathers), "largest gather": max(gathers, default=0),
        "gathered": sum(gathers)}}


def _ms(b: dict, batch, steps: int) -> float:
    b["state"], metrics = b["step"](b["state"], batch)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        b["state"], metrics = b["step"](b["state"], batch)
        jax.block_until_ready((b["state"], metrics))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(layers: int = 6, width: int = 512, steps: int = 3) -> dict:
    """{mode: figures} on this process's devices, each mode built after the last is freed."""
    models = lm1b_models()
    config = models.TransformerConfig(
        vocab_size=VOCAB, output_vocab_size=VOCAB, emb_dim=width, qkv_dim=width,
        mlp_dim=4 * width, num_layers=layers, max_len=LENGTH, deterministic=True)
    unrolled, scan = models.TransformerLM(config), scanned(models)(config)
    rng = np.random.default_rng(0)
    batch = jdp.shard({"tokens": rng.integers(1, VOCAB, (PER_DEVICE * jax.device_count(),
                                                         LENGTH)).astype(np.int32)})
    modes = {"replicated": (unrolled, _loss(unrolled), {}),
             "ZeRO": (unrolled, _loss(unrolled), {"shard_optimizer": True}),
             "FSDP, gathers left to the compiler": (
                 unrolled, jdp.layer_policy(_loss(unrolled), enabled=False),
                 {"shard_params": True}),
             "FSDP, one layer at a time (default)": (
                 unrolled, _loss(unrolled), {"shard_params": True}),
             "FSDP, the model scanned": (scan, _loss(scan), {"shard_params": True})}
    out = {}
    for mode, (net, loss, options) in modes.items():
        b = _build(net, loss, options, batch)
        out[mode] = {**b["figures"], "ms": _ms(b, batch, steps)}
        del b
        gc.collect()
    return out


HEADER = ["mode", "params + AdamW at rest MiB", "step peak MiB", "all-gathers",
          "largest all-gather MiB", "ms / step"]


def table(r: dict) -> str:
    """The table, from one 8-device process: 6 x 512 in the full run, 2 x 256 in the quick one
    (`zero_params` of 3M), none for a smaller `zero_params` (the smoke tests)."""
    size = r["settings"].get("zero_params", 0)
    if size < 1_000_000:
        return "Not measured (`zero_params` under 1M).\n"
    layers, width = (6, 512) if size >= 10_000_000 else (2, 256)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.fsdp_unrolled", str(layers),
                           str(width)], cwd=jobs.REPO, text=True, capture_output=True,
                          timeout=3000, env=jobs.base_env("default",
                                                         XLA_FLAGS=jobs.device_flags(8)))
    if proc.returncode:
        return f"Failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}\n"
    found = json.loads(proc.stdout.splitlines()[-1])
    rows = [[mode, report.fmt(f["rest"] / MiB, 1), report.fmt(f["peak"] / MiB, 1),
             f["gathers"], report.fmt(f["largest gather"] / MiB, 2), report.fmt(f["ms"], 0)]
            for mode, f in found.items()]
    return (f"lm1b's TransformerLM (examples/flax_lm1b/models.py), {layers} layers of {width}, "
            f"vocabulary {VOCAB}, AdamW, {PER_DEVICE} x {LENGTH} tokens per device, 8 "
            "simulated devices. Peak: `memory_analysis()` of the compiled step; all-gathers: "
            "counted in its HLO.\n\n" + report.table(HEADER, rows))


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    print(json.dumps(measure(*args)))
