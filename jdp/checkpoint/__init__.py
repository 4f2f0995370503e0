"""Checkpoints of a training job: one logical copy of the state and the Loader's position."""
from jdp.checkpoint._checkpointer import Checkpointer
from jdp.checkpoint._integrity import CorruptCheckpointError

__all__ = ["Checkpointer", "CorruptCheckpointError"]
