"""Scalars of a run where people look: JSON lines always, TensorBoard, MLflow when installed."""
from jdp.metrics._writer import Writer

__all__ = ["Writer"]
