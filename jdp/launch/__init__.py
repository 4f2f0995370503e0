"""The launcher: `python -m jdp.launch` / `jdp-launch`, and `jdp.spawn`.

A job runs in rounds (`_rounds`: node 0's keeper, one node or many alike); in each round
`_supervisor` runs this node's ranks through the rank-side runner (`_run`) and says how the
round ended as one `_outcome.Outcome`, which one formatter reports. Standard library only:
nothing here imports JAX.
"""
from jdp.launch._cli import main
from jdp.launch._spawn import ProcessExitedException, ProcessRaisedException, spawn

__all__ = ["ProcessExitedException", "ProcessRaisedException", "main", "spawn"]
