"""Save and restore a replicated train state, with the data loader's position, through orbax.

DDP's `torch.save` on rank 0 plus the sampler position, made atomic and multi-process aware:

* One copy is saved: device 0's, as host (numpy) arrays, since every device holds the same
  values. A restore copies it onto however many devices the process has now (8 -> 2 works).
* Every process calls `save`; they check that they agree on the step, then process 0 writes.
* Atomic: orbax writes `<step>.orbax-checkpoint-tmp/` and renames it to `<step>/` when done. A
  process killed mid-save leaves only the tmp directory, which is never listed as a step and
  is deleted by the next `Checkpointer` on the directory.
* Synchronous: when `save` returns, the checkpoint is on disk and the process may exit or be
  killed. Writing a small model takes milliseconds, not worth a background thread that
  every exit path would have to drain first.

Only array leaves are saved; the rest (`apply_fn`, `tx`) comes from the state given to restore.
"""
from __future__ import annotations

import json
import operator
import os
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import traverse_util
from jax._src import distributed as _jax_distributed  # private: is there a process group?

from jdp.distributed import barrier

_STATE, _LOADER = "state", "loader"


class Checkpointer:
    """Keeps the last `max_to_keep` checkpoints of a replicated train state in `directory`.

    Every process of the job creates one on the same (shared) directory and calls `save` and
    `restore` with the same arguments in the same order.

    Args:
        directory: where step directories `<step>/` go (a path or an orbax-supported URL
            such as gs://...); created if missing.
        max_to_keep: how many of the newest checkpoints to keep (None keeps all).
        timeout_s: seconds a process waits for the others at a save or restore before raising
            TimeoutError (a peer that is dead, stuck, or skipped the call). orbax's own
            barriers inside a save wait up to 300 s.

    Example:
        >>> ckpt = jdp.checkpoint.Checkpointer("/tmp/run1", max_to_keep=3)
        >>> state = ckpt.restore(state, loader=loader)     # unchanged on a fresh run
        >>> for epoch in range(loader.epoch, num_epochs):
        ...     loader.set_epoch(epoch)
        ...     for batch in loader:
        ...         state, metrics = step(state, batch)
        ...     ckpt.save(int(jdp.unreplicate(state).step), state, loader=loader)
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 3, *,
                 timeout_s: float = 300.0):
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep={max_to_keep!r} must be an integer >= 1, or None "
                             "to keep every checkpoint")
        text = os.fspath(directory)  # a local path, or a URL such as gs://bucket/run
        self.directory = text if "://" in text else os.path.abspath(os.path.expanduser(text))
        self.timeout_s = float(timeout_s)
        self._key = f"jdp.checkpoint:{self.directory}"
        # Every process may create it: exist_ok makes the race harmless (orbax refuses to
        # create it itself once `active_processes` is set).
        epath.Path(self.directory).mkdir(parents=True, exist_ok=True)
        self._manager = ocp.CheckpointManager(
            self.directory, options=_manager_options(max_to_keep),
            handler_registry=_registry(_multiprocessing_options()))
        # orbax deletes leftover tmp directories in a thread that it joins only at the next
        # save; a short restore-only run would exit under it (an error in the log). Join now.
        getattr(self._manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()

    def save(self, step: int, state: Any, loader: Any = None) -> None:
        """Write device 0's copy of `state` (and `loader`'s position) as checkpoint `step`.

        Call it on every process. Returns once the checkpoint is complete on disk; the oldest
        checkpoints beyond `max_to_keep` are then deleted.

        Args:
            step: a non-negative integer, larger than every step already saved here.
            state: the replicated state, as from `jdp.replicate` or a jdp step.
            loader: a `jdp.data.Loader` (anything with a JSON-serialisable `state_dict()`),
                whose position is stored with the state.

        Raises:
            ValueError: `state` is not replicated, `step` is not new, or the processes passed
                different steps.
            TimeoutError: another process did not reach the save within `timeout_s`.

        Example:
            >>> ckpt.save(1000, state, loader=loader)
        """
        step = _as_step(step)
        tree = _host_tree(state)
        position = _loader_position(loader)
        self._agree("save", step)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(
                f"Checkpointer.save: step {step} is not after the latest checkpoint {latest} in "
                f"{self.directory}; steps must increase. Pass a larger step (e.g. the state's "
                "step counter), or save into a new directory")
        items = {_STATE: ocp.args.StandardSave(tree)}
        if position is not None:
            items[_LOADER] = ocp.args.JsonSave(position)
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, state: Any, loader: Any = None, step: int | None = None) -> Any:
        """Load checkpoint `step` (default: the newest) into the structure of `state`.

        `state` gives the structure, dtypes and placement: the result is replicated over this
        process's current devices, whatever their number at save time. Every process reads
        the same files. With no checkpoint in the directory, `state` comes back unchanged and
        `loader` is left alone, so a training script can call it unconditionally.

        Args:
            state: a replicated state (as from `jdp.replicate`) of the model being trained.
            loader: the loader whose position to restore (`loader.load_state_dict`).
            step: which checkpoint to load; None for the newest.

        Returns:
            `state` with every array leaf replaced by the checkpoint's values.

        Raises:
            ValueError: the checkpoint does not match `state` (the message names the first
                differing leaf), `step` was not saved, or it holds no loader position.

        Example:
            >>> state = ckpt.restore(jdp.replicate(initial_state), loader=loader)
        """
        step = self.latest_step() if step is None else self._existing(_as_step(step))
        self._agree("restore", step)
        if step is None:
            return state
        items = {_STATE: ocp.args.StandardRestore()}
        if loader is not None:
            self._require_loader_item(step)
            items[_LOADER] = ocp.args.JsonRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        new_state = _fill(state, traverse_util.flatten_dict(restored[_STATE]))
        if loader is not None:
            loader.load_state_dict(restored[_LOADER])
        return new_state

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when nothing has been saved."""
        self._manager.reload()  # the directory, not this object's memory, is the truth
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of all complete checkpoints in the directory, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def close(self) -> None:
        """Release orbax's resources. Saves are already complete when `save` returns."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _existing(self, step: int) -> int:
        steps = self.all_steps()
        if step not in steps:
            raise ValueError(f"Checkpointer.restore: no checkpoint for step {step} in "
                             f"{self.directory}; saved steps: {steps}. Pass one of those, or "
                             "step=None for the newest")
        return step

    def _require_loader_item(self, step: int) -> None:
        if _LOADER not in self._manager.item_metadata(step):
            raise ValueError(
                f"Checkpointer.restore: checkpoint {step} in {self.directory} holds no loader "
                "position (it was saved with loader=None); pass loader=None to restore only "
                "the state")

    def _agree(self, what: str, step: int | None) -> None:
        """Raise on every process unless all processes chose the same `step`."""
        client = _jax_distributed.global_state.client
        if client is None or jax.process_count() == 1:
            return
        key = f"{self._key}/{what}"
        # Overwriting last call's value is safe: nobody sets again before all have read.
        client.key_value_set(f"{key}/{jax.process_index()}", str(step), allow_overwrite=True)
        barrier(f"{key}/set", self.timeout_s)
        seen = {int(k.rsplit("/", 1)[1]): v for k, v in client.key_value_dir_get(key)}
        barrier(f"{key}/read", self.timeout_s)
        if len(set(seen.values())) > 1:
            raise ValueError(
                f"Checkpointer.{what}: processes chose different steps "
                f"{dict(sorted(seen.items()))} (process: step; None = no checkpoint). Every "
                f"process must call {what} with the same step on the same shared directory")


def _manager_options(max_to_keep: int | None) -> ocp.CheckpointManagerOptions:
    policy = None if max_to_keep is None else ocp.checkpoint_managers.LatestN(max_to_keep)
    return ocp.CheckpointManagerOptions(
        preservation_policy=policy, enable_async_checkpointing=False, create=False,
        cleanup_tmp_directories=True,  # leftovers of a killed save (process 0 deletes them)
        multiprocessing_options=_multiprocessing_options())


def _multiprocessing_options() -> ocp.options.MultiprocessingOptions:
    # Naming the processes makes orbax wait at coordination-service barriers, which time out,
    # instead of device all-reduces, which can hang forever.
    processes = set(range(jax.process_count())) if jax.process_count() > 1 else None
    return ocp.options.MultiprocessingOptions(primary_host=0, active_processes=processes)


def _registry(mp: ocp.options.MultiprocessingOptions) -> ocp.handlers.CheckpointHandlerRegistry:
    """Which orbax handler saves each item (so that a fresh manager can restore quietly)."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state, loader = (ocp.StandardCheckpointHandler(multiprocessing_options=mp),
                     ocp.JsonCheckpointHandler(multiprocessing_options=mp))
    for args, item, handler in ((ocp.args.StandardSave, _STATE, state),
                                (ocp.args.StandardRestore, _STATE, state),
                                (ocp.args.JsonSave, _LOADER, loader),
                                (ocp.args.JsonRestore, _LOADER, loader)):
        registry.add(item, args, handler)
    return registry


def _as_step(step: Any) -> int:
    try:
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"step={step!r} must be an integer, e.g. "
                        "int(jdp.unreplicate(state).step)") from None
    if value < 0:
        raise ValueError(f"step={value} must be >= 0")
    return value


def _loader_position(loader: Any) -> dict | None:
    if loader is None:
        return None
    position = loader.state_dict()
    try:
        json.dumps(position)
    except TypeError as e:
        raise TypeError(f"{type(loader).__name__}.state_dict() must return JSON-serialisable "
                        f"data to be checkpointed; got {position!r} ({e})") from None
    return position


def _array_leaves(tree: Any) -> Iterator[tuple[Any, Any]]:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, (jax.Array, np.ndarray)):
            yield path, leaf


def _keys(path: Any) -> tuple[str, ...]:
    """A tree path as the string keys of the nested dict that is saved."""
    # DictKey / FlattenedIndexKey have .key, GetAttrKey .name, SequenceKey .idx.
    keys = tuple(str(next((getattr(e, a) for a in ("key", "name", "idx") if hasattr(e, a)), e))
                 for e in path)
    return keys or ("value",)


def _per_device(path: Any, leaf: Any, where: str) -> tuple[tuple[int, ...], Any]:
    """(shape, dtype) of one device's copy of a replicated leaf; ValueError if not replicated."""
    n = jax.local_device_count()
    if leaf.ndim == 0 or leaf.shape[0] != n:
        raise ValueError(
            f"{where}: leaf {_name(path)} has shape {leaf.shape}; expected a replicated state, "
            f"whose leaves have a leading axis of {n} (jax.local_device_count()). Pass the "
            "state from jdp.replicate(...) or from a jdp step, not a single copy")
    return leaf.shape[1:], leaf.dtype


def _host_tree(state: Any) -> dict:
    """Device 0's copy of every array leaf of `state`, as a nested dict of numpy arrays."""
    flat = {}
    for path, leaf in _array_leaves(state):
        _per_device(path, leaf, "Checkpointer.save")
        data = leaf.addressable_data(0) if isinstance(leaf, jax.Array) else leaf  # [1, ...]
        # A copy, not a view: a later donated step may reuse the device buffer.
        flat[_keys(path)] = np.array(np.asarray(data)[0])
    if not flat:
        raise ValueError(f"Checkpointer.save: the state {type(state).__name__} has no array "
                         "leaves, so there is nothing to save; pass the replicated train state")
    return traverse_util.unflatten_dict(flat)


def _fill(state: Any, saved: dict[tuple, np.ndarray]) -> Any:
    """`state` with each array leaf replaced by `saved`'s value, replicated like the leaf."""
    where = "Checkpointer.restore"
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    out = []
    for path, leaf in leaves:
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            out.append(leaf)
            continue
        shape, dtype = _per_device(path, leaf, where)
        value = saved.pop(_keys(path), None)
        if value is None:
            raise ValueError(f"{where}: the checkpoint does not match the state: missing in "
                             f"checkpoint: {_name(path)} (state has shape {shape}). Restore "
                             "into a state built like the one that was saved")
        value = np.asarray(value)
        _check_leaf(path, value, shape, dtype)
        out.append(_replicate_like(value, leaf))
    if saved:
        extra = next(iter(saved))
        raise ValueError(f"{where}: the checkpoint does not match the state: in checkpoint but "
                         f"not in state: {extra[0]}{''.join(f'[{k!r}]' for k in extra[1:])}. "
                         "Restore into a state built like the one that was saved")
    return jax.tree_util.tree_unflatten(treedef, out)


def _check_leaf(path: Any, value: np.ndarray, shape: tuple, dtype: Any) -> None:
    if value.shape != shape:
        raise ValueError(f"Checkpointer.restore: the checkpoint does not match the state: "
                         f"{_name(path)}: checkpoint has shape {value.shape}, state has {shape}")
    if value.dtype != dtype:
        raise ValueError(f"Checkpointer.restore: the checkpoint does not match the state: "
                         f"{_name(path)}: checkpoint has dtype {value.dtype}, state has {dtype}. "
                         "Restore into a state of the saved dtypes, then cast")


def _replicate_like(value: np.ndarray, leaf: Any) -> Any:
    """`value` copied onto each device that `leaf` is replicated over."""
    copies = np.broadcast_to(value, leaf.shape)
    return jax.device_put(copies, leaf.sharding) if isinstance(leaf, jax.Array) else copies.copy()


def _name(path: Any) -> str:
    return jax.tree_util.keystr(path).lstrip(".") or "<root>"
