"""The SPMD floor: the math of a data-parallel step, with no job in it.

What one step computes on global arrays over one data mesh, importing only JAX, flax, optax
and jdp's standard-library value checks (`jdp.job.values`), so it can be read and tested
without processes, agreement or dispatch:

- `mesh`: the 1-D data mesh (`jdp.AXIS`), HSDP's 2-D view of it, placement helpers;
- `storage`: how ZeRO and FSDP store a leaf split over the devices, and their updates;
- `strategies`: one strategy per storage (replicated, ZeRO, FSDP, HSDP), each a step's two
  halves, gradients and update, behind one interface; `reduce_gradients`;
- `grads`: one device's gradient (the user's loss in its documented form, the one
  micro-batch loop), FSDP's and HSDP's mapped gradients;
- `layers`, `layers_flax`: FSDP's per-layer gathers (`jdp.layer`, `jdp.layer_policy`);
- `outputs`, `rng`: what the user's functions return and take, checked while they trace.

The step floor (`jdp.core`: the step object, its option and input checks, dispatch,
agreement, the in-flight bound) builds on these modules, named by module (this package
re-exports nothing: its modules are its interface); `jdp` re-exports the public names.
"""
