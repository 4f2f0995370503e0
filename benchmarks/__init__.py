"""jdp's benchmark suite: `python -m benchmarks --output BENCHMARKS.md [--quick]` (what `make
bench` runs). `harness/` runs the jobs and renders BENCHMARKS.md; every other module is one
benchmark and renders its own table (`cnn`: the CNN jobs' summary and tables 1-8)."""
