"""Parity run, jdp side: the CNN trained with jdp's launcher, sampler, Loader and train_step.

    python -m jdp.launch --nproc_per_node 2 tests/system/examples/_parity_jdp.py \
        DATA.npz OUT.json STEPS

Reads the examples and the initial weights from DATA.npz (written by test_torch_parity.py),
feeds them in torch's unshuffled DistributedSampler order, and writes the global loss of each
step (process 0) to OUT.json.
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdp

PARAMS = ("c1w", "c1b", "c2w", "c2b", "d1w", "d1b", "d2w", "d2b")
BATCH, LR, MOMENTUM = 32, 0.01, 0.9  # per process; the torch side uses the same


def conv(x, w, b):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC")) + b


def pool(x):
    b, h, w, c = x.shape
    return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def forward(p, x):
    x = pool(jax.nn.relu(conv(x, p["c1w"], p["c1b"])))
    x = pool(jax.nn.relu(conv(x, p["c2w"], p["c2b"])))
    x = jax.nn.relu(x.reshape(x.shape[0], -1) @ p["d1w"] + p["d1b"])
    return x @ p["d2w"] + p["d2b"]


def loss_fn(params, batch):
    logits = forward(params, batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def main(data_path, out_path, steps):
    jdp.initialize()
    data = np.load(data_path)
    params = {k: jnp.asarray(data[k]) for k in PARAMS}
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params,
                                                tx=optax.sgd(LR, momentum=MOMENTUM)))
    source = {"image": data["image"], "label": data["label"].astype(np.int32)}
    sampler = jdp.data.DistributedSampler(len(data["label"]), shuffle=False)
    loader = jdp.data.Loader(source, BATCH, sampler=sampler, drop_last=True)
    step, losses = jdp.train_step(loss_fn), []
    for batch in loader:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if len(losses) == steps:
            break
    if jdp.is_primary():
        with open(out_path, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
