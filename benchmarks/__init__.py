"""jdp's benchmark suite: `python -m benchmarks.run --output BENCHMARKS.md [--quick]`.

Compared variants run interleaved in rounds (A B C, then C B A, ...) because the machines this
runs on are shared: absolute numbers drift with other people's load, ratios taken inside one
round much less. `run` lists the tables; `report` renders them; `worker` and `torch_ddp` are
the measured processes, driven through `protocol`; `zero` measures optimizer-state sharding.
"""
