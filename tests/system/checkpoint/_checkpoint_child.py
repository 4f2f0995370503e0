"""Model and child processes for test_checkpoint.py (beside it).

Run as `python tests/system/checkpoint/_checkpoint_child.py MODE DIRECTORY OUT`; the parent sets
the device count (and, for "two_process", the rank variables) in the environment.
"""
import asyncio
import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdp


class Net(nn.Module):
    """An MLP with BatchNorm (model state) and Dropout (rng): every kind of state there is."""
    hidden: int = 16

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(
            nn.Dense(self.hidden)(x)))
        x = nn.Dropout(0.25, deterministic=not train)(x)
        return nn.Dense(3)(x)


def make_state(seed: int = 0, hidden: int = 16) -> jdp.TrainState:
    """A single-copy train state: MLP + BatchNorm statistics + Adam + dropout key."""
    model = Net(hidden)
    variables = model.init(jax.random.key(seed), jnp.ones((2, 8)), train=False)
    return jdp.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                 tx=optax.adam(1e-2), model_state=variables["batch_stats"],
                                 seed=seed)


def host_leaves(state) -> dict:
    """{path: numpy value} of every array leaf of a single-copy state."""
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def _hang_in_rename(directory: str, out: str) -> None:
    """Save step 1, then save step 2 but stop for good just before orbax's final rename.

    That is the last moment of a save: every file of step 2 is written (commit_success.txt
    too), only the rename of the tmp directory to `2/` is missing. The parent kills us here.
    """
    from orbax.checkpoint._src.path import async_path
    ckpt = jdp.checkpoint.Checkpointer(directory)
    ckpt.save(1, jdp.replicate(make_state(1)))
    rename = async_path.rename

    async def stuck_rename(src, dst, *args, **kwargs):
        if os.path.basename(str(dst)) != "2":  # the items inside the step go through
            return await rename(src, dst, *args, **kwargs)
        with open(out, "w") as f:
            f.write(str(src))
        await asyncio.sleep(3600)

    async_path.rename = stuck_rename
    ckpt.save(2, jdp.replicate(make_state(2)))


def _restore(directory: str, out: str) -> None:
    """Restore the newest checkpoint on this process's devices and dump what arrived."""
    state = jdp.checkpoint.Checkpointer(directory).restore(jdp.replicate(make_state(99)))
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    np.savez(out, **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})


def global_state(state):
    """`state` as the global layout: every array leaf replicated on jdp's mesh (no device axis)."""
    from jdp.core import replicated
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x), replicated()), state)


def _dump(out: str, **states) -> None:
    """Save {state name + leaf path: every addressable shard stacked} for the parent to check."""
    arrays = {}
    for label, state in states.items():
        for p, x in jax.tree_util.tree_flatten_with_path(state)[0]:
            key = f"{label}{jax.tree_util.keystr(p)}"
            arrays[key] = np.stack([np.asarray(s.data) for s in x.addressable_shards])
            arrays[f"{key}.replicated"] = np.asarray(x.sharding.is_fully_replicated)
    np.savez(out, **arrays)


def _restore_both(directory: str, out: str) -> None:
    """Restore the newest checkpoint into the global and the stacked layout of this process."""
    ckpt = jdp.checkpoint.Checkpointer(directory)
    _dump(out, global_=ckpt.restore(global_state(make_state(99))),
          stacked=ckpt.restore(jdp.replicate(make_state(99))))


def _two_process_global(directory: str, out: str) -> None:
    """Both processes save a global state spanning them; restore it in both layouts."""
    jdp.initialize()
    from jdp.core import replicated
    to_global = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.make_array_from_process_local_data(replicated(), np.asarray(x)), tree)
    state = to_global(make_state(4))
    assert not state.params["Dense_0"]["kernel"].is_fully_addressable
    ckpt = jdp.checkpoint.Checkpointer(directory, timeout_s=30)
    ckpt.save(3, state)
    fresh = jdp.checkpoint.Checkpointer(directory, timeout_s=30)
    _dump(f"{out}.{jax.process_index()}.npz", global_=fresh.restore(to_global(make_state(99))),
          stacked=fresh.restore(jdp.replicate(make_state(99))))
    # ZeRO: optimizer moments sharded over both processes' devices (gathered for the CRC).
    zero = jdp.checkpoint.Checkpointer(os.path.join(directory, "zero"), timeout_s=30)
    zero.save(1, jdp.broadcast(busy_state(4), shard_optimizer=True))
    restored = zero.restore(jdp.broadcast(make_state(99)))  # unsharded: fully addressable here
    np.savez(f"{out}.zero.{jax.process_index()}.npz", **{
        jax.tree_util.keystr(p): np.asarray(x.addressable_data(0))
        for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]})
    # An asynchronous save that nobody waits for: the exit must finish it on both processes
    # (before jax.distributed shuts down, which orbax's barriers need).
    jdp.checkpoint.Checkpointer(os.path.join(directory, "async"), async_save=True).save(
        7, to_global(make_state(4)))


def busy_state(seed: int) -> jdp.TrainState:
    """make_state(seed) with non-zero optimizer moments and count (Adam starts at zeros)."""
    state = make_state(seed)
    rng = np.random.default_rng(seed)
    return state.replace(opt_state=jax.tree.map(
        lambda x: np.asarray(rng.normal(size=np.shape(x)) * 100).astype(np.asarray(x).dtype),
        state.opt_state))


def _zero_roundtrip(directory: str, out: str) -> None:
    """Restore an 8-device sharded checkpoint here (2 devices) unsharded and sharded; then save
    the sharded state from here into `directory`/back for the parent to restore on 8."""
    ckpt = jdp.checkpoint.Checkpointer(directory)
    unsharded = ckpt.restore(jdp.broadcast(make_state(99)))
    sharded = ckpt.restore(jdp.broadcast(make_state(99), shard_optimizer=True))
    arrays = {f"{label}{jax.tree_util.keystr(p)}": np.asarray(x)
              for label, state in (("unsharded", unsharded), ("sharded", sharded))
              for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
    arrays.update({f"spec{jax.tree_util.keystr(p)}": np.asarray(str(x.sharding.spec))
                   for p, x in jax.tree_util.tree_flatten_with_path(sharded)[0]})
    np.savez(out, **arrays)
    jdp.checkpoint.Checkpointer(os.path.join(directory, "back")).save(1, sharded)


def _two_process(directory: str, out: str) -> None:
    """Each process saves its own (rank-dependent) values; both restore; report the results."""
    jdp.initialize()
    from jdp.data import Loader
    from jdp.pmap import local_sharding
    rank, n = jax.process_index(), jax.local_device_count()
    loader = Loader({"x": np.arange(40, dtype=np.float32)}, batch_size=4, shuffle=True)
    batches = iter(loader)
    for _ in range(1 + rank):  # positions differ: process 0's must be the one restored
        next(batches)

    def replicated(tree):
        return jax.tree.map(lambda x: jax.device_put(
            np.broadcast_to(x, (n, *np.shape(x))), local_sharding()), tree)

    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3) * (rank + 1),
             "step": np.int32(7 + rank)}
    ckpt = jdp.checkpoint.Checkpointer(directory, max_to_keep=2, timeout_s=3)
    result = {"empty_latest": ckpt.latest_step()}
    for step in (1, 2, 3):
        ckpt.save(step, replicated(state), loader=loader)
    result["steps_after_save"] = ckpt.all_steps()
    loader = Loader({"x": np.arange(40, dtype=np.float32)}, batch_size=4, shuffle=True)
    fresh = jdp.checkpoint.Checkpointer(directory, timeout_s=3)
    restored = fresh.restore(replicated({"w": np.zeros((2, 3), np.float32),
                                         "step": np.int32(0)}), loader=loader)
    result["w"] = [np.asarray(s.data).tolist() for s in restored["w"].addressable_shards]
    result["step"] = np.asarray(restored["step"]).tolist()
    result["loader"] = [loader.epoch, loader.step]
    try:
        fresh.save(4 + rank, replicated(state))
    except ValueError as e:
        result["different_steps_error"] = str(e)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    if rank == 0:  # process 1 skips this save and ends: named on both at once, both exit 1
        fresh.save(10, replicated(state))


if __name__ == "__main__":
    mode, directory, out = sys.argv[1:4]
    {"hang_in_rename": _hang_in_rename, "restore": _restore, "restore_both": _restore_both,
     "two_process": _two_process, "two_process_global": _two_process_global,
     "zero_roundtrip": _zero_roundtrip}[mode](directory, out)
