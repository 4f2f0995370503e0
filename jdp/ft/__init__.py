"""Fault-tolerant data parallelism across replica groups, on torchft (the `jdp[ft]` extra).

A job of R replica groups: each group is its own jdp job (its own `jax.distributed`
coordinator, processes and devices, any layout inside); across groups one all-reduce of the
gradient per step runs on torchft's process group, reconfigured by its Lighthouse at each
step's quorum. A group that dies costs the others one discarded step; when its launcher
restarts it, it heals from a live peer over the network.
"""
