"""The rank side's state of a job, in one object: what this process of a jdp job keeps while
it runs.

`current()` is this process's `Rank`, made on first use; jdp's steps, Loader, Checkpointer and
`jdp.initialize()` read and update its parts, each owned by the package that uses it:

- `progress` (`jdp.job.progress.Progress`): the progress slot the watchdog and goodput read;
- `stop` (`jdp.job.progress.Preemption`): SIGTERM's flag and the agreed stop (`preempted`);
- `in_flight`: calls of jdp's own steps and the user's own steps counted through its batches
  (`jdp.core`'s bound on steps in flight);
- `agreement`: the agreement points begun per topic, and whether the job was checked
  (`jdp.distributed`);
- `peers` (`jdp.job.peers.Peers`): the roll call's connections, what the peers said, the
  collective call this process waits in;
- `profile`: the `--profile_steps` window and whether a trace runs (`jdp.metrics.profile`).

A test builds its own with `Rank()` and drives the parts directly.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jdp.job import peers as _peers
from jdp.job import progress as _progress


@dataclasses.dataclass
class InFlight:
    """jdp's own step calls (while they run, the user's batches stand aside), the user's
    own steps, counted through the Loader's batches, and `jdp.shard`'s bound on the batches
    it hands out (a `jdp.core.StepWindow`, made at its first call)."""
    jdp_calls: int = 0
    own_steps: int = 0
    shard_window: Any = None


@dataclasses.dataclass
class Agreement:
    """Agreement points begun per topic (the n-th call of a topic meets the n-th elsewhere),
    whether `require_job` passed (later calls cost one attribute read), and the batch
    signatures `jdp.shard` agreed on (each agreed once)."""
    rounds: dict = dataclasses.field(default_factory=dict)
    job_checked: bool = False
    shard_signatures: set = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class ProfileState:
    """The `--profile_steps` window (read from the environment once) and whether this rank
    traces now."""
    window: Any = None
    read: bool = False
    tracing: bool = False


@dataclasses.dataclass
class Rank:
    """One process's state in a jdp job (see the module docstring)."""
    progress: _progress.Progress = dataclasses.field(default_factory=_progress.Progress)
    stop: _progress.Preemption = dataclasses.field(default_factory=_progress.Preemption)
    in_flight: InFlight = dataclasses.field(default_factory=InFlight)
    agreement: Agreement = dataclasses.field(default_factory=Agreement)
    peers: _peers.Peers = dataclasses.field(init=False)
    profile: ProfileState = dataclasses.field(default_factory=ProfileState)

    def __post_init__(self) -> None:
        self.peers = _peers.Peers(self.progress)


_CURRENT = Rank()


def current() -> Rank:
    """This process's `Rank`."""
    return _CURRENT


def record(phase: str, step: int | None = None) -> None:
    """This rank enters `phase` (`Progress.record` of `current()`)."""
    _CURRENT.progress.record(phase, step)


def preempted() -> bool:
    """True once this job was asked to stop (SIGTERM to the launcher or to any rank).

    Call it once per iteration of the training loop; on every rank it turns True at the same
    iteration, agreed through the train step's own all-reduce (no extra collective), so all
    ranks can save one checkpoint at one step and leave:

        for batch in loader:
            state, metrics = step(state, batch)
            if jdp.preempted():
                ckpt.save(step_count, state, loader=loader)
                break

    The first call makes this process catch SIGTERM (until then SIGTERM ends it as usual).
    Before any jdp train step has run (or with no step at all, e.g. a single process's own
    loop) it is this process's own flag, not an agreed one.
    """
    return _CURRENT.stop.preempted()
