"""Fault-tolerant data parallelism across replica groups, on torchft (the `jdp[ft]` extra).

A job of R replica groups: each group is its own jdp job (its own `jax.distributed`
coordinator, processes and devices, any layout inside); across groups one all-reduce of the
gradient per step runs on torchft's process group, reconfigured by its Lighthouse at each
step's quorum. A group that dies costs the others one discarded step; when its launcher
restarts it, it heals from a live peer over the network. Groups compare a fingerprint of what
they built before they train together (a difference stops every group with one line), and a
group never trains from the initial state while the job has gone on, nor alone unless
`min_groups` allows it.

The names resolve on first use, so the launcher imports `jdp.ft.lighthouse` without JAX.

    replicas = jdp.ft.Replicas(state, loader)   # loader over jdp.ft.sampler(len(source))
    for state, metrics in replicas.train(loss_fn, num_steps):   # jdp.train_step's options
        ...

or, the same attempts with the step in the caller's loop:

    step = replicas.train_step(loss_fn)
    for batch in replicas.batches(num_steps):
        state, metrics = step(state, batch)
"""
from __future__ import annotations

import importlib

_SOURCES = {"Replicas": "jdp.ft._replicas", "sampler": "jdp.ft._replicas",
            "lighthouse": "jdp.ft.lighthouse"}
__all__ = list(_SOURCES)


def __getattr__(name: str):
    """Import the module behind a public name the first time it is read."""
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'jdp.ft' has no attribute {name!r}")
    module = importlib.import_module(source)
    value = module if source == f"jdp.ft.{name}" else getattr(module, name)
    globals()[name] = value
    return value
