"""How jdp's checkpoints use orbax: manager options, item handlers, and the directory's layout.

A checkpoint directory holds finished steps `<step>/` (each with orbax's commit marker), the
tmp directories of saves in progress or of writers that died, and `.jdp-deleting/`, where old
steps are renamed before they are deleted so that a reader never sees half of one. Only the
writer (process 0 of the job that saves) removes anything.
"""
from __future__ import annotations

import re

import jax
import orbax.checkpoint as ocp
from etils import epath

STATE, LOADER, INTEGRITY = "state", "loader", "integrity"  # the items of one checkpoint
TRASH = ".jdp-deleting"  # old steps are renamed in here, then deleted, by the writer
_LEFTOVER = re.compile(r"^\d+\.orbax-checkpoint-tmp")  # a save that never finished
_DONE = "commit_success.txt"  # orbax writes it last, before the final rename


def complete_steps(root: epath.Path) -> list[int]:
    """Steps of the finished checkpoints under `root`, oldest first (none if it is missing)."""
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(p.name) for p in entries if p.name.isdigit() and (p / _DONE).exists())


def remove_leftovers(root: epath.Path) -> None:
    """Delete unfinished saves and old steps a writer left (call on the writer, before it saves)."""
    for path in root.iterdir():
        if _LEFTOVER.match(path.name):
            path.rmtree()
    empty_trash(root)


def empty_trash(root: epath.Path) -> None:
    """Delete the old steps that orbax's max_to_keep renamed into the trash."""
    trash = root / TRASH
    if trash.exists():
        trash.rmtree()


def manager_options(max_to_keep: int | None, async_save: bool) -> ocp.CheckpointManagerOptions:
    """orbax's CheckpointManager options for one writer and any number of readers."""
    policy = None if max_to_keep is None else ocp.checkpoint_managers.LatestN(max_to_keep)
    return ocp.CheckpointManagerOptions(
        preservation_policy=policy, enable_async_checkpointing=async_save, create=False,
        # Readers must never delete: leftovers of a killed save are removed by `save`.
        cleanup_tmp_directories=False,
        # Old steps leave by one rename (a reader sees all of a step or none of it).
        todelete_subdir=TRASH,
        # Do not read every step's metadata at construction: a writer may be deleting one.
        lightweight_initialize=True,
        multiprocessing_options=_multiprocessing_options())


def _multiprocessing_options() -> ocp.options.MultiprocessingOptions:
    # Naming the processes makes orbax wait at coordination-service barriers, which time out,
    # instead of device all-reduces, which can hang forever.
    processes = set(range(jax.process_count())) if jax.process_count() > 1 else None
    return ocp.options.MultiprocessingOptions(primary_host=0, active_processes=processes)


def registry() -> ocp.handlers.CheckpointHandlerRegistry:
    """Which orbax handler saves each item (so that a fresh manager can restore quietly)."""
    mp = _multiprocessing_options()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state = ocp.PyTreeCheckpointHandler(multiprocessing_options=mp)
    for item in (LOADER, INTEGRITY):
        json_handler = ocp.JsonCheckpointHandler(multiprocessing_options=mp)
        registry.add(item, ocp.args.JsonSave, json_handler)
        registry.add(item, ocp.args.JsonRestore, json_handler)
    registry.add(STATE, ocp.args.PyTreeSave, state)
    registry.add(STATE, ocp.args.PyTreeRestore, state)
    return registry
