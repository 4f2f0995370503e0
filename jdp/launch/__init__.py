"""The launcher: `python -m jdp.launch` / `jdp-launch`, and `jdp.spawn`.

A job runs in rounds (`_rounds`: node 0's keeper, one node or many alike); in each round
`_supervisor` runs this node's ranks through the rank-side runner (`jdp.job.run`) and says how
the round ended as one `jdp.job.outcome.Outcome`, which one formatter reports. What the
launcher and its ranks agree on lives below, in `jdp.job`; nothing in jdp imports this package
but `jdp`'s re-export of `spawn`. Standard library only: nothing here imports JAX.
"""
from jdp.launch._cli import main
from jdp.launch._spawn import ProcessExitedException, ProcessRaisedException, spawn

__all__ = ["ProcessExitedException", "ProcessRaisedException", "main", "spawn"]
