"""The baseline of `benchmarks.ft`: `examples/fault_tolerant.py`'s model, batch and optimizer
as one plain jdp job (no replica groups): a `jdp.train_step` loop, optionally saving a disk
checkpoint every K steps and resuming from the newest one when `--max_restarts` restarts it.

    python -m jdp.launch --nproc_per_node 3 --devices_per_process 2 --max_restarts 9 \\
        -m benchmarks.ft_plain --events EV.jsonl --steps 1000000 --checkpoint_dir CK --every 100

Each process appends `{"event": "join", "rank", "pid", "restart", "time"}` to `--events` when
it starts; process 0 appends `{"event": "step", "step", "time"}` every `--sync_every` steps,
after waiting for that step's state (the loop does not wait in between, as a training loop
that logs every few steps).
"""
from __future__ import annotations

import argparse
import os

import fault_tolerant as example  # examples/ (on PYTHONPATH in the benchmark's jobs)
import jax
import optax

import jdp
from jdp.job import events


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", required=True, help="the JSON-lines file to append to")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=16, help="per process")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--sync_every", type=int, default=10)
    p.add_argument("--checkpoint_dir", default=None)
    p.add_argument("--every", type=int, default=100, help="checkpoint every this many steps")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    jdp.initialize()
    primary = jax.process_index() == 0
    events.append(args.events, "join", rank=jax.process_index(), pid=os.getpid(),
          restart=int(os.environ.get("JDP_RESTART_COUNT", 0)))
    loader = jdp.data.Loader(example.dataset(), batch_size=args.batch_size, drop_last=True)
    state = jdp.broadcast(jdp.TrainState.create(
        apply_fn=None, params=example.init_params(args.width), tx=optax.adam(args.lr)))
    ckpt = (jdp.checkpoint.Checkpointer(args.checkpoint_dir, max_to_keep=2)
            if args.checkpoint_dir else None)
    if ckpt is not None:
        state = ckpt.restore(state, loader)
    step_fn, step = jdp.train_step(example.loss_fn), int(state.step)
    while step < args.steps:
        for batch in loader:
            state, _ = step_fn(state, batch)
            step += 1
            if step % args.sync_every == 0:
                jax.block_until_ready(state)
                if primary:
                    events.append(args.events, "step", step=step)
            if ckpt is not None and step % args.every == 0:
                ckpt.save(step, state, loader=loader)
            if step >= args.steps:
                break
    if ckpt is not None:
        ckpt.close()


if __name__ == "__main__":
    main()
