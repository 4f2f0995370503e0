"""The benchmark harness: starts the measured jobs, times them in interleaved rounds, and
writes the tables into BENCHMARKS.md. No table lives here; each lives in its benchmark's
module beside this package (`run.TABLES` lists them in order).

- `control`: long-lived jobs driven through request files (`Worker`, `serve`), `interleave`.
- `jobs`: the CNN jobs' command lines and environments, and the settings every job shares.
- `run`: `python -m benchmarks` (what `make bench` runs): measure, render, splice.
- `report`: the generated block's header and the pieces every table is made of.
- `hlo`, `profile`: what a compiled step's HLO and a `jax.profiler` trace say.
"""
from benchmarks.harness.control import Worker, interleave, serve, timed, write_json

__all__ = ["Worker", "interleave", "serve", "timed", "write_json"]
