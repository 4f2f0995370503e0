"""Save and restore a train state, with the data loader's position, through orbax.

* One logical copy: each shard of a global state is written once, by the process holding it;
  a stacked state is saved as one copy (`jdp.core.layouts.to_global`). A restore places the values
  like the `state` it is given, in either form, on any device or process count.
* Atomic: orbax writes `<step>.orbax-checkpoint-tmp-*/` and renames it to `<step>/` when done;
  old steps leave by a rename too, so a reader never sees half of one. Only `save` (on process
  0) deletes anything, so evaluators may restore from a directory a job is saving into.
* Verified (see `_integrity`) without a host copy: a damaged newest checkpoint is skipped with
  a warning naming the file or array; an explicitly requested one raises.

* One writer: process 0 names its job in `.jdp-writer` (`_owner`); a second job saving into the
  directory is refused. Step directories without orbax's commit marker are moved out before a
  save, so they never count toward `max_to_keep`.

Array and number leaves are saved (a number comes back as its own type); any other leaf is
refused; static fields (`apply_fn`, `tx`) come from the state given to restore.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import warnings
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import jax

from jdp.checkpoint import _integrity, _owner
from jdp.checkpoint import _tree as tree
from jdp.checkpoint._integrity import CorruptCheckpointError, Damaged
from jdp.core import layouts, not_donated
from jdp.distributed import agree, barrier, require_job
from jdp.job import rank as _rank
from jdp.job import values
from jdp.job.env import MAX_SECONDS

WHO = "jdp.checkpoint.Checkpointer"

_RELISTS = 20  # how often a reader lists again when a writer deletes what it was reading


class Checkpointer:
    """Keeps the last `max_to_keep` checkpoints of a train state in `directory`.

    Every process of the job calls `save` and `restore` with the same arguments in the same
    order, on the same (shared) directory; other jobs may list and restore. Constructing one,
    `latest_step()` and `all_steps()` are local: any process may call them alone (e.g. inside
    `if jax.process_index() == 0:`); a save or restore that a process skips is named on every
    process within seconds.

    Args:
        directory: where step directories `<step>/` go (a path or an orbax-supported URL
            such as gs://...); created by the first `save` if missing.
        max_to_keep: how many of the newest checkpoints to keep (None keeps all).
        timeout_s: seconds a process waits for the others at a save or restore before raising
            TimeoutError (a peer that is dead, stuck, or skipped the call). orbax's own
            barriers inside a save wait up to 300 s.
        async_save: return from `save` once the arrays are copied to host memory and write
            them in a background thread, finished by every later call and at interpreter exit
            (also after an uncaught exception, or a SIGTERM handled by `jdp.preempted()`); a
            kill meanwhile loses only that checkpoint. `close()` raises a failed write.

    Example (a training loop saves `ckpt.save(step, state, loader=loader)` the same way):
        >>> import tempfile, numpy as np, jdp
        >>> state = jdp.broadcast({"w": np.zeros(3, np.float32)})
        >>> with tempfile.TemporaryDirectory() as directory:
        ...     ckpt = jdp.checkpoint.Checkpointer(directory, max_to_keep=2)
        ...     state = ckpt.restore(state)          # unchanged: nothing saved yet
        ...     for step in range(1, 4):
        ...         state = {"w": state["w"] + 1}    # one training step
        ...         ckpt.save(step, state)
        ...     print(ckpt.all_steps(), ckpt.restore(state, step=2)["w"])
        [2, 3] [2. 2. 2.]
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 3, *,
                 timeout_s: float = 300.0, async_save: bool = False):
        require_job(WHO)
        if max_to_keep is not None:
            max_to_keep = values.integer(WHO, "max_to_keep", max_to_keep, minimum=1,
                                         fix="or None to keep every checkpoint")
        timeout_s = values.seconds(WHO, "timeout_s", timeout_s, maximum=MAX_SECONDS)
        async_save = values.flag(WHO, "async_save", async_save)
        text = os.fspath(directory)  # a local path, or a URL such as gs://bucket/run
        self.directory = text if "://" in text else os.path.abspath(os.path.expanduser(text))
        from jdp.checkpoint import _orbax as disk  # not at `import jdp`: orbax takes 0.5 s
        self._root, self._disk = disk.epath.Path(self.directory), disk
        if self._root.exists() and not self._root.is_dir():
            raise ValueError(f"Checkpointer: directory {self.directory!r} is a file, not a "
                             "directory; pass a directory path (it is created if missing)")
        self.timeout_s = timeout_s
        self._max_to_keep = max_to_keep
        self._made: Any = None   # orbax's manager, built after the first agreement (`_manager`)
        self._async, self._closed = async_save, False
        self._damaged: set[int] = set()   # steps a restore found damaged: a save may replace them
        self._claimed, self._saving = False, None
        if async_save:
            # Private: Python's only exit hook that runs before concurrent.futures stops taking
            # work (which orbax's writer needs); atexit runs after that, too late. No public API.
            threading._register_atexit(self._finish)

    def save(self, step: int, state: Any, loader: Any = None) -> None:
        """Write `state`'s logical copy (and `loader`'s position) as checkpoint `step`.

        Call it on every process. Also deletes the checkpoints beyond `max_to_keep` and the
        leftovers of saves that a killed process never finished.

        Args:
            step: a non-negative integer, larger than every step already saved here.
            state: the train state, global (ZeRO-sharded or not) or stacked (`jdp.pmap`), or
                any subtree of one (`state.params`: FSDP's parameters are recorded in the
                model's shapes, so they restore into plain parameters or another layout).
            loader: a `jdp.data.Loader` (anything with a JSON-serialisable `state_dict()`),
                whose position is stored with the state.

        Raises:
            ValueError: `state` has no arrays, `step` is not new, or the processes passed
                different steps.
            TimeoutError: another process did not reach the save within `timeout_s`.

        Example:
            >>> import tempfile, jax, numpy as np, jdp
            >>> n = jax.local_device_count()   # the batch is split over the local devices
            >>> loader = jdp.data.Loader({"x": np.arange(4 * n, dtype=np.float32)}, 2 * n)
            >>> with tempfile.TemporaryDirectory() as directory:
            ...     batch = next(iter(loader))
            ...     jdp.checkpoint.Checkpointer(directory).save(
            ...         1, jdp.pmap.replicate({"w": np.ones(3)}), loader=loader)
        """
        _rank.record("checkpoint")
        self._wait()
        step = _as_step(step)
        not_donated(state)
        found = tree.leaves(layouts.to_global(state, "Checkpointer.save"), "Checkpointer.save")
        position = _loader_position(loader)
        self._agree("save", step, [(leaf.name, f"{leaf.dtype}{list(leaf.shape)}")
                                   for leaf in found])
        latest = ([s for s in self.all_steps() if s not in self._damaged] or [None])[-1]
        if latest is not None and step <= latest:
            raise ValueError(
                f"Checkpointer.save: step {step} is not after the latest checkpoint {latest} in "
                f"{self.directory}; steps must increase. Pass a larger step (e.g. the state's "
                "step counter), or save into a new directory")
        self._prepare_to_write(step)
        self._saving = step
        with self._no_space():
            self._write(step, found, position)
            if not self._async:
                self._saving = None
                self._empty_trash()

    @property
    def _manager(self) -> Any:
        """orbax's CheckpointManager, built at the first save or restore, after its agreement:
        orbax's constructor waits for every process in a barrier of its own, so building it
        in `__init__` would make constructing a Checkpointer collective (and one built on one
        process alone would hang there, before any agreement could name it)."""
        if self._made is None:
            self._made = self._disk.manager(self.directory, self._max_to_keep, self._async)
        return self._made

    def _write(self, step: int, found: list, position: Any) -> None:
        """Hand the arrays, loader position and record to orbax, whose (background) write empties
        the trash and makes the record from the devices' hashes. With `async_save` these are
        dispatched after orbax's copy to host, which must not queue behind them on a device."""
        first = _integrity.record(found, position) if jax.process_index() == 0 else {}
        hashed: futures.Future = futures.Future()

        def record() -> dict:
            self._empty_trash()
            return {**first, "hashes": _integrity.process_sums(
                [leaf.name for leaf in found], hashed.result(timeout=self.timeout_s))}

        if not self._async:
            hashed.set_result(_integrity.hashes(found, [leaf.leaf for leaf in found]))
        try:
            self._manager.save(step, force=True,
                               args=self._disk.save_args(found, record, position))
        finally:
            if not hashed.done():
                hashed.set_result(_integrity.hashes(found, [leaf.leaf for leaf in found]))

    def restore(self, state: Any, loader: Any = None, step: int | None = None) -> Any:
        """Load checkpoint `step` (default: the newest intact one) into the structure of `state`.

        Each leaf comes back laid out like `state`'s (global, ZeRO-sharded or stacked, on this
        run's devices), whatever the layout and device count at save. With no checkpoint in
        the directory, `state` comes back unchanged and `loader` is left alone.

        Args:
            state: a state of the model being trained, global or stacked.
            loader: the loader whose position to restore (`loader.load_state_dict`).
            step: which checkpoint to load; None for the newest intact one (a damaged newer
                one is skipped with a warning naming the file or array).

        Raises:
            ValueError: the checkpoint does not match `state` (the message names the first
                differing leaf), `step` was not saved, or it holds no loader position.
            CorruptCheckpointError: checkpoint `step` (or, with step=None, every checkpoint)
                is damaged; the message names the file or array.

        Example:
            >>> import tempfile, numpy as np, jdp
            >>> with tempfile.TemporaryDirectory() as directory:
            ...     ckpt = jdp.checkpoint.Checkpointer(directory)
            ...     ckpt.save(5, jdp.pmap.replicate({"w": np.arange(3.0)}))   # the pmap form
            ...     state = ckpt.restore(jdp.broadcast({"w": np.zeros(3)}))   # the global one
            >>> state["w"], state["w"].sharding.is_fully_replicated
            (Array([0., 1., 2.], dtype=float32), True)
        """
        _rank.record("checkpoint")
        self._wait()
        target = layouts.to_global(state, "Checkpointer.restore")
        found = tree.leaves(target, "Checkpointer.restore")
        if loader is not None and not callable(getattr(loader, "load_state_dict", None)):
            raise TypeError(f"Checkpointer.restore: loader={type(loader).__name__} has no "
                            "load_state_dict(); pass a jdp.data.Loader, or loader=None")
        asked = None if step is None else _as_step(step)
        self._agree("restore", asked, [(leaf.name, f"{leaf.dtype}{list(leaf.shape)}")
                                       for leaf in found] + [("a loader", str(loader is not None))])
        if asked is not None and asked not in self.all_steps():
            raise ValueError(f"Checkpointer.restore: no checkpoint for step {asked} in "
                             f"{self.directory}; saved steps: {self.all_steps()}. Pass one of "
                             "those, or step=None for the newest")
        chosen, values, position = self._first_intact(found, loader, asked)
        self._agree("restored", chosen)   # a save between two processes' listings: named
        if chosen is None:
            return state
        if loader is not None:
            loader.load_state_dict(position)
        return layouts.like(state, tree.rebuild(target, values), "Checkpointer.restore")

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when nothing has been saved.

        Local: it lists the directory and waits for no other process."""
        return (self.all_steps() or [None])[-1]

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (listed anew: a job may be saving)."""
        self._wait()
        return self._disk.complete_steps(self._root)

    def close(self) -> None:
        """Finish a background save (raising if it failed) and release orbax's resources."""
        self._finish()
        if self._made is not None:
            self._made.close()

    def _wait(self) -> None:
        """Let this Checkpointer's background save, if any, finish (raising if it failed)."""
        if self._async and self._made is not None:
            with self._no_space():
                self._made.wait_until_finished()
            self._saving = None

    @contextlib.contextmanager
    def _no_space(self) -> Iterator[None]:
        """A full disk as one line naming the directory and step, not orbax's pages."""
        try:
            yield
        except Exception as e:
            if not self._disk.out_of_space(e):
                raise
            error = OSError(f"no space left on {self.directory} while saving step "
                            f"{self._saving}; free space or save elsewhere (the earlier "
                            "checkpoints are intact)")
            error.errno, self._saving = errno.ENOSPC, None
            raise error from None

    def _finish(self) -> None:
        """Finish a background save and empty the trash, once (at `close` or interpreter exit)."""
        if self._async and not self._closed:
            self._closed = True
            self._wait()
            self._empty_trash()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _first_intact(self, found: list, loader: Any,
                      asked: int | None) -> tuple[int | None, list, Any]:
        """Read checkpoint `asked`, or else the newest that verifies: (step, values in `found`
        order, loader position); step None when the directory holds no checkpoint."""
        damaged: dict[int, str] = {}
        for _ in range(_RELISTS):  # a writer may delete the steps we were about to read
            steps = [asked] if asked is not None else [
                s for s in reversed(self.all_steps()) if s not in damaged]
            for step in steps:
                try:
                    return (step, *self._read(step, found, loader))
                except Damaged as e:
                    vanished = step not in self.all_steps()  # max_to_keep removed it
                    if asked is not None:
                        raise CorruptCheckpointError(
                            f"Checkpointer.restore: checkpoint {step} in {self.directory} "
                            + ("was deleted while being read" if vanished else
                               f"is damaged: {e}") + ". Restore another step (step=None "
                            "picks the newest intact one)") from None
                    if vanished:
                        break  # list again: newer steps may have appeared meanwhile
                    damaged[step] = str(e)
                    self._damaged.add(step)
                    warnings.warn(f"Checkpointer.restore: checkpoint {step} in "
                                  f"{self.directory} is damaged ({e}); trying the next older "
                                  "checkpoint", RuntimeWarning, stacklevel=3)
            else:
                break
        if damaged:
            raise CorruptCheckpointError(
                f"Checkpointer.restore: no intact checkpoint in {self.directory}: "
                f"{'; '.join(f'{s}: {e}' for s, e in damaged.items())}. Restore from a copy, "
                "or start afresh in a new directory")
        if self.all_steps():
            raise CorruptCheckpointError(
                f"Checkpointer.restore: every checkpoint in {self.directory} was deleted while "
                f"being read, {_RELISTS} times over; is a writer saving with a small "
                "max_to_keep? Retry, or raise max_to_keep")
        return None, [], None

    def _read(self, step: int, found: list, loader: Any) -> tuple[list, Any]:
        """Checkpoint `step`'s values in `found` order and loader position, verified."""
        disk = self._disk
        record = _integrity.checked(self._checked_read(
            step, lambda: disk.RecordHandler().restore(self._root / str(step) / disk.INTEGRITY),
            f"{disk.INTEGRITY} item ({_integrity.RECORD_FILE})"))
        _integrity.check_structure(record["arrays"], found, step)
        if loader is not None and record["loader_crc32"] is None:
            raise ValueError(
                f"Checkpointer.restore: checkpoint {step} in {self.directory} holds no loader "
                "position (it was saved with loader=None); pass loader=None to restore only "
                "the state")
        restored = self._checked_read(step, lambda: self._manager.restore(
            step, args=disk.restore_args(found, loader is not None)), "state item")
        values = disk.values(restored, found)
        position = restored.get(disk.LOADER) if loader is not None else None
        _integrity.verify(found, values, position, record)
        return [tree.restored(leaf, v) for leaf, v in zip(found, values, strict=True)], position

    def _checked_read(self, step: int, read: Any, what: str) -> Any:
        """`read()`, with any failure turned into Damaged naming the file."""
        self._disk.quiet_closed_loop_callbacks()
        try:
            return read()
        except Exception as e:  # tensorstore, orbax, json and OS errors alike
            raise _integrity.from_error(e, os.path.join(self.directory, str(step)), what) from None

    def _prepare_to_write(self, step: int) -> None:
        """Create the directory; on process 0, claim it (`_owner`) and move out of the way the
        unfinished saves of crashed writers and the damaged steps this save replaces."""
        try:
            self._root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"Checkpointer.save: cannot create the checkpoint directory "
                             f"{self.directory!r} ({e.strerror or e}); pass a writable "
                             "directory path") from None
        if jax.process_index() == 0:
            _owner.claim(self._root, self.directory, self._claimed)
            self._claimed = True
            stray = self._disk.remove_leftovers(self._root, {s for s in self._damaged if s >= step})
            if stray:
                warnings.warn(f"Checkpointer.save: removed step directories {stray} from "
                              f"{self.directory}: saves that never committed (or not "
                              "checkpoints at all), which would count toward max_to_keep",
                              RuntimeWarning, stacklevel=3)
        self._damaged = {s for s in self._damaged if s < step}
        if jax.process_count() > 1:  # every process's orbax must see the same steps
            barrier(f"jdp.checkpoint:{self.directory}/prepared", self.timeout_s)
        self._manager.reload()  # max_to_keep counts the steps on disk, not in memory

    def _empty_trash(self) -> None:
        if jax.process_index() == 0:
            self._disk.empty_trash(self._root)

    def _agree(self, what: str, step: int | None, leaves: list | None = None) -> None:
        """Raise on every process unless all call `what` on the same directory with the same
        `step` (and the same state's `leaves`); a process that skips the call is named
        (`jdp.distributed.agree`). Save and restore agree before any of orbax's work, which
        waits for every process in barriers of its own; "restored" agrees on the step read."""
        facts = [("the directory", self.directory), ("the step", str(step)), *(leaves or [])]
        call = "restore" if what == "restored" else what
        agree(f"checkpoint-{what}", facts, f"Checkpointer.{call}",
              f"every process must call {what} with the same step and state on one shared "
              "directory (the same path on every process)", self.timeout_s)


def _as_step(step: Any) -> int:
    return values.integer("Checkpointer", "step", step, minimum=0, fix="e.g. int(state.step)")


def _loader_position(loader: Any) -> dict | None:
    if loader is None:
        return None
    if not callable(getattr(loader, "state_dict", None)):
        raise TypeError(f"Checkpointer.save: loader={type(loader).__name__} has no "
                        "state_dict(); pass a jdp.data.Loader, or loader=None")
    position = loader.state_dict()
    try:
        json.dumps(position)
    except TypeError as e:
        raise TypeError(f"{type(loader).__name__}.state_dict() must return JSON-serialisable "
                        f"data to be checkpointed; got {position!r} ({e})") from None
    return position

