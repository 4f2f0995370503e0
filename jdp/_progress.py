"""Progress and preemption signals shared by jdp's steps, the Loader and the Checkpointer.

Interface only for now (filled in by the fault-tolerance work): the steps call `record` and
read `stop_flag()`; they report the stop decision that all ranks agreed on with `set_agreed`.
"""
from __future__ import annotations

_agreed = False
_local_stop = False


def record(phase: str, step: int | None = None) -> None:
    """Note that this rank made progress (`phase`: "step", "data", "eval", "checkpoint")."""


def stop_flag() -> bool:
    """True once this process was asked to stop (SIGTERM): a local, unagreed request."""
    return _local_stop


def set_agreed(flag: bool) -> None:
    """The stop decision every rank computed in the same step's all-reduce."""
    global _agreed
    _agreed = _agreed or bool(flag)


def preempted() -> bool:
    """True on every rank at the same step once any rank was asked to stop."""
    return _agreed
