"""jdp's benchmark suite: `python -m benchmarks.run --output BENCHMARKS.md [--quick]`.

Every figure is the median of several rounds in which the compared variants run interleaved
(A B C ... then ... C B A), because the 2-core machines this runs on are shared: absolute
numbers drift with other people's load, ratios taken inside one round much less.

Modules:
    cnn        the MNIST CNN of `examples/mnist.py`, a scale-and-shift BatchNorm variant, and a
               hand-written `jax.pmap` + `lax.pmean` step to hold jdp against
    timing     interleaved rounds, medians, per-round ratios
    worker     a benchmark process (any device count, or one rank of a launched job) that
               builds its steps once, then times them whenever the parent says "go"
    torch_ddp  the same CNN under PyTorch DDP (gloo, CPU), run under torchrun as a worker
    hlo        all-reduce ops and bytes in a compiled step, and the bytes expected from the trees
    gradcheck  gradients of each BatchNorm formulation against a float64 reference
    loader     jdp.data.Loader throughput against the train step's consumption rate
    report     BENCHMARKS.md
    run        the entry point: starts the workers, runs the rounds, writes the report
"""
