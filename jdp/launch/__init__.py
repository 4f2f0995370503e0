"""The launcher: `python -m jdp.launch` / `jdp-launch` and `jdp.spawn`, one supervisor.

Standard library only: the launcher imports no JAX.
"""
from jdp.launch._cli import main
from jdp.launch._spawn import ProcessExitedException, ProcessRaisedException, spawn

__all__ = ["ProcessExitedException", "ProcessRaisedException", "main", "spawn"]
