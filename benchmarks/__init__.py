"""jdp's benchmark suite: `python -m benchmarks.run --output BENCHMARKS.md [--quick]` (`run`
lists the tables, `report` renders them, `harness` drives the measured jobs in rounds)."""
