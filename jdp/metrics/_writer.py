"""`jdp.metrics.Writer`: one call per step records scalars in every place a run is watched.

Only the primary process writes (the others' writers do nothing), so a training script calls
it unchanged on every rank. Always `LOGDIR/metrics.jsonl`, one JSON object per call
(`{"step": 10, "time": ..., "loss": 0.31}`), strict JSON readable without any library (a
non-finite value as the string "NaN", "Infinity" or "-Infinity"); TensorBoard event
files in LOGDIR (through tensorboardX, which needs no TensorFlow) when it is installed; an
MLflow run when mlflow is installed and a tracking URI is set (MLFLOW_TRACKING_URI) or a run
is active. The launcher writes its goodput figures through the same writer.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from typing import Any

from jdp.job import values as _values


class Writer:
    """Records scalars per step: JSON lines, TensorBoard events, MLflow.

    Args:
        logdir: the directory to write into (created); `tensorboard --logdir LOGDIR` shows it.
        primary: whether this process writes; None asks JAX (process 0 writes).
        tensorboard: write TensorBoard event files; None: when tensorboardX is installed.
        mlflow: log to MLflow; None: when mlflow is installed and a tracking URI is set
            (MLFLOW_TRACKING_URI) or a run is active.

    Example:
        >>> import tempfile, jdp
        >>> with tempfile.TemporaryDirectory() as logdir:
        ...     with jdp.metrics.Writer(logdir, tensorboard=False) as writer:
        ...         writer.scalars(1, {"loss": 0.5, "accuracy": 0.9})
        ...     print(open(f"{logdir}/metrics.jsonl").read().count("loss"))
        1
    """

    def __init__(self, logdir: str, *, primary: bool | None = None,
                 tensorboard: bool | None = None, mlflow: bool | None = None):
        if not isinstance(logdir, (str, os.PathLike)):
            raise TypeError(f"Writer: logdir={logdir!r} is not a path; pass a directory name")
        primary, tensorboard, mlflow = (
            None if value is None else _values.flag("jdp.metrics.Writer", name, value,
                                                    fix="or None for the default")
            for name, value in (("primary", primary), ("tensorboard", tensorboard),
                                ("mlflow", mlflow)))
        self.logdir = os.fspath(logdir)
        self.primary = _is_primary() if primary is None else primary
        self._jsonl = self._tb = self._mlflow = None
        if not self.primary:
            return
        os.makedirs(self.logdir, exist_ok=True)
        self._jsonl = open(os.path.join(self.logdir, "metrics.jsonl"), "a", encoding="utf-8")
        self._tb = _tensorboard(self.logdir, tensorboard)
        self._mlflow = _mlflow(mlflow)

    def scalars(self, step: int, values: Mapping[str, Any]) -> None:
        """Record `values` (name -> number, e.g. a jax scalar) at training step `step`."""
        step = _values.integer("jdp.metrics.Writer.scalars", "step", step, minimum=0,
                               fix="the training step the values belong to")   # on every rank
        if self._jsonl is None:
            return
        if not isinstance(values, Mapping):
            raise TypeError(f"Writer.scalars: values={type(values).__name__} must be a mapping "
                            "of names to numbers, e.g. {'loss': 0.3}")
        numbers_ = {str(k): _number(k, v) for k, v in values.items()}
        row = {"step": int(step), "time": time.time(), **numbers_}
        self._jsonl.write(json.dumps({k: _json_number(v) for k, v in row.items()},
                                     allow_nan=False) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for name, value in numbers_.items():
                self._tb.add_scalar(name, value, int(step))
        if self._mlflow is not None:
            self._mlflow.log_metrics({_mlflow_name(k): v for k, v in numbers_.items()
                                      if math.isfinite(v)}, step=int(step))

    def flush(self) -> None:
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flush and close every destination (calling it again does nothing)."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        self._jsonl = self._tb = self._mlflow = None

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_primary() -> bool:
    import jax  # only here: the launcher passes primary=True and never starts a backend
    return jax.process_index() == 0


def _number(name: Any, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"Writer.scalars: {name!r}={value!r} is not a number; pass scalars "
                        "(a float, int or one-element array)") from None


def _json_number(value: float) -> float | str:
    """A number as strict JSON holds it: a non-finite one as the string "NaN", "Infinity" or
    "-Infinity" (protobuf's JSON form; Python's `float()` reads all three back), since a
    bare NaN makes the whole file unreadable to jq and strict parsers."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def _quiet_non_finite(record: logging.LogRecord) -> bool:
    """tensorboardX warns on stderr at each non-finite scalar; the writer records them as
    values (a NaN loss is worth a point on the plot, not a stray line)."""
    return "NaN or Inf found" not in record.getMessage()


def _tensorboard(logdir: str, wanted: bool | None):
    """A tensorboardX SummaryWriter, or None (not wanted, or not installed with None)."""
    if wanted is False:
        return None
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        if wanted:
            raise ImportError("Writer(tensorboard=True) needs tensorboardX: pip install "
                              "tensorboardX (or jdp[examples])") from None
        return None
    logging.getLogger("tensorboardX.x2num").addFilter(_quiet_non_finite)   # once: same object
    return SummaryWriter(logdir=logdir, flush_secs=10)


def _mlflow(wanted: bool | None):
    """The mlflow module with a run started, or None."""
    if wanted is False:
        return None
    try:
        import mlflow
    except ImportError:
        if wanted:
            raise ImportError("Writer(mlflow=True) needs mlflow: pip install mlflow") from None
        return None
    if wanted is None and not (os.environ.get("MLFLOW_TRACKING_URI") or mlflow.active_run()):
        return None
    if mlflow.active_run() is None:
        mlflow.start_run()
    return mlflow


def _mlflow_name(name: str) -> str:
    """MLflow allows letters, digits and _-./ space in metric names."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in name)
