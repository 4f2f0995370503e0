"""Printing and logging once per job: `print0` and `get_logger` speak from process 0."""
from __future__ import annotations

import logging
import os
from typing import Any

import jax

from jdp.job import env as _env
from jdp.job import values


def print0(*args: Any, **kwargs: Any) -> None:
    """`print` on process 0 only (flushed), so a message appears once per job.

    Example:
        >>> import jdp
        >>> epoch, loss = 1, 0.25
        >>> jdp.print0(f"epoch {epoch}: loss {loss:.3f}")   # printed by process 0 only
        epoch 1: loss 0.250
    """
    if _rank_hint() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


class _RankFilter(logging.Filter):
    """Stamps records with the rank; on ranks > 0 lets only warnings and errors through."""

    def __init__(self, all_ranks: bool):
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _rank_hint()
        return self.all_ranks or record.rank == 0 or record.levelno >= logging.WARNING


def get_logger(name: str = "jdp", level: int = logging.INFO,
               all_ranks: bool = False) -> logging.Logger:
    """A logger whose lines carry the rank, INFO from process 0 only.

    Safe to create at import time, before `initialize`: the rank is looked up per record.

    Args:
        all_ranks: let every process log at `level`, not only process 0 (warnings and errors
            always come from every process).

    Example:
        >>> import jdp
        >>> log = jdp.get_logger("train")
        >>> log.info("step %d loss %.3f", 10, 0.25)  # stderr: "... [rank0] INFO train: step 10"
    """
    all_ranks = values.flag("jdp.get_logger", "all_ranks", all_ranks,
                            fix="True logs INFO from every process")
    logger = logging.getLogger(name)
    for f in [f for f in logger.filters if isinstance(f, _RankFilter)]:
        logger.removeFilter(f)
    logger.addFilter(_RankFilter(all_ranks))
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(
            "%(asctime)s [rank%(rank)s] %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
    return logger


def _rank_hint() -> int:
    """This process's rank without starting a JAX backend (which would block `initialize`)."""
    if jax.distributed.is_initialized():
        return jax.process_index()
    try:
        return int(os.environ.get(_env.RANK, "0"))
    except ValueError:
        return 0
