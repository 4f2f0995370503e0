"""How jdp's checkpoints use orbax (imported by the first Checkpointer, not by `import jdp`).

A checkpoint directory holds finished steps `<step>/` (each with orbax's commit marker), the
tmp directories of unfinished saves, and `.jdp-deleting/`, where old steps are renamed before
they are deleted. A step holds three items: `state` (the arrays), `loader` (the position, if
any) and `integrity` (one record per process).
"""
from __future__ import annotations

import dataclasses
import errno
import json
import re
import sys
import uuid
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import traverse_util

from jdp.checkpoint._integrity import Damaged

STATE, LOADER, INTEGRITY = "state", "loader", "integrity"  # the items of one checkpoint
TRASH = ".jdp-deleting"  # old steps are renamed in here, then deleted, by the writer
_LEFTOVER = re.compile(r"^\d+\.orbax-checkpoint-tmp")  # a save that never finished
_DONE = "commit_success.txt"  # orbax writes it last, before the final rename


def manager(directory: str, max_to_keep: int | None, async_save: bool) -> ocp.CheckpointManager:
    """orbax's CheckpointManager for one writer and any number of readers."""
    policy = None if max_to_keep is None else ocp.checkpoint_managers.LatestN(max_to_keep)
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policy, enable_async_checkpointing=async_save, create=False,
        # Readers must never delete: leftovers of a killed save are removed by `save`.
        cleanup_tmp_directories=False,
        # Old steps leave by one rename (a reader sees all of a step or none of it).
        todelete_subdir=TRASH,
        # Do not read every step's metadata at construction: a writer may be deleting one.
        lightweight_initialize=True,
        multiprocessing_options=_multiprocessing_options())
    return ocp.CheckpointManager(directory, options=options, handler_registry=_registry())


def _multiprocessing_options() -> ocp.options.MultiprocessingOptions:
    # Naming the processes makes orbax wait at coordination-service barriers, which time out,
    # instead of device all-reduces, which can hang forever.
    processes = set(range(jax.process_count())) if jax.process_count() > 1 else None
    return ocp.options.MultiprocessingOptions(primary_host=0, active_processes=processes)


@dataclasses.dataclass
class RecordSave(ocp.args.CheckpointArgs):
    """This process's integrity record, made by `make()` in the background write."""
    make: Callable[[], dict]


class RecordHandler(ocp.AsyncCheckpointHandler):
    """Writes `integrity/metadata` (process 0) or `metadata.process_<i>` before the commit."""

    async def async_save(self, directory: epath.Path, args: RecordSave) -> list:
        async def write():
            self.save(directory, args)
        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="jdp_record")]

    def save(self, directory: epath.Path, args: RecordSave) -> None:
        text = json.dumps(args.make())
        (directory / _record_name(jax.process_index())).write_text(text)

    def restore(self, directory: epath.Path, args: Any = None) -> list:
        """Every process's record, process 0's first."""
        first = json.loads((directory / _record_name(0)).read_text())
        count = first.get("processes") if isinstance(first, dict) else None
        return [first, *(json.loads((directory / _record_name(i)).read_text())
                         for i in range(1, count if isinstance(count, int) else 1))]


def _record_name(process: int) -> str:
    return "metadata" if process == 0 else f"metadata.process_{process}"


def _registry() -> ocp.handlers.CheckpointHandlerRegistry:
    """Which orbax handler saves each item (so that a fresh manager can restore quietly)."""
    mp = _multiprocessing_options()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    loader = ocp.JsonCheckpointHandler(multiprocessing_options=mp)
    state, record = ocp.PyTreeCheckpointHandler(multiprocessing_options=mp), RecordHandler()
    for item, handler, args in [(LOADER, loader, (ocp.args.JsonSave, ocp.args.JsonRestore)),
                                (STATE, state, (ocp.args.PyTreeSave, ocp.args.PyTreeRestore)),
                                (INTEGRITY, record, (RecordSave,))]:
        for arg in args:
            registry.add(item, arg, handler)
    return registry


def save_args(found: list, make_record: Callable[[], dict], position: Any) -> Any:
    """The items of one checkpoint: the arrays of `found` as a nested dict, record, position."""
    state = traverse_util.unflatten_dict({leaf.keys: leaf.leaf for leaf in found})
    items = {STATE: ocp.args.PyTreeSave(state), INTEGRITY: RecordSave(make_record)}
    if position is not None:
        items[LOADER] = ocp.args.JsonSave(position)
    return ocp.args.Composite(**items)


def restore_args(found: list, loader: bool) -> Any:
    """The items to read: each array as its template leaf is (strict=False cuts or zero-fills
    ZeRO's padding), and the loader."""
    targets = {leaf.keys: _target(leaf) for leaf in found}
    items = {STATE: ocp.args.PyTreeRestore(
        traverse_util.unflatten_dict({k: t[0] for k, t in targets.items()}),
        restore_args=traverse_util.unflatten_dict({k: t[1] for k, t in targets.items()}))}
    if loader:
        items[LOADER] = ocp.args.JsonRestore()
    return ocp.args.Composite(**items)


def values(restored: Any, found: list) -> list:
    """The arrays of a restored checkpoint in `found` order; Damaged if one is missing."""
    flat = traverse_util.flatten_dict(restored[STATE])
    for leaf in found:
        if flat.get(leaf.keys) is None:
            raise Damaged(f"array {leaf.name}: missing from the restored state")
    return [flat[leaf.keys] for leaf in found]


def _target(leaf: Any) -> tuple[Any, ocp.RestoreArgs]:
    if isinstance(leaf.leaf, np.ndarray):
        # A zero-byte view of the right shape and dtype: orbax reads it as "numpy, please".
        return (np.broadcast_to(np.empty((), leaf.dtype), leaf.shape),
                ocp.RestoreArgs(restore_type=np.ndarray))
    sharding = leaf.leaf.sharding
    return (jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            ocp.ArrayRestoreArgs(sharding=sharding, global_shape=leaf.shape, strict=False))


def complete_steps(root: epath.Path) -> list[int]:
    """Steps of the finished checkpoints under `root`, oldest first (none if it is missing)."""
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(p.name) for p in entries if p.name.isdigit() and (p / _DONE).exists())


def remove_leftovers(root: epath.Path, replaced: set[int]) -> list[str]:
    """Delete the unfinished saves a killed writer left, and move to the trash the step
    directories without orbax's commit marker (returned: they would count toward max_to_keep)
    and the `replaced` steps (call on the writer, before it saves)."""
    stray = []
    for path in root.iterdir():
        if _LEFTOVER.match(path.name):
            path.rmtree()
        elif path.name.isdigit() and path.is_dir() and (
                int(path.name) in replaced or not (path / _DONE).exists()):
            if int(path.name) not in replaced:
                stray.append(path.name)
            (root / TRASH).mkdir(exist_ok=True)
            path.rename(root / TRASH / f"{path.name}.{uuid.uuid4().hex}")
    return sorted(stray, key=int)


def empty_trash(root: epath.Path) -> None:
    """Delete the old steps that orbax's max_to_keep renamed into the trash."""
    if (root / TRASH).exists():
        (root / TRASH).rmtree()

def out_of_space(error: BaseException | None) -> bool:
    """Whether `error`, or an error it chains, says the disk is full."""
    seen = 0
    while error is not None and seen < 20:
        if getattr(error, "errno", None) == errno.ENOSPC or "No space left" in str(error):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False



def quiet_closed_loop_callbacks() -> None:
    """Drop the stray "Event loop is closed" tracebacks of a failed read, and only those.

    orbax reads in an event loop of its own and closes it when one read fails (a damaged
    checkpoint), while tensorstore still completes the reads it had started: their callbacks
    then fail in tensorstore's threads, printed after the clear error as tracebacks that say
    nothing about the checkpoint. Every other unraisable error goes to the previous hook.
    """
    previous = sys.unraisablehook
    if getattr(previous, "_jdp_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
            previous(unraisable)

    hook._jdp_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
