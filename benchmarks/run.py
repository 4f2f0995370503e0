"""Run jdp's benchmarks and write their tables into BENCHMARKS.md (what `make bench` runs):
`python -m benchmarks.run [--output BENCHMARKS.md] [--quick] [--only 2dev+malloc,torch]`.

One long-lived job per configuration (`benchmarks.jobs`), started and compiled once:
`1dev 2dev 4dev 8dev` (one process, k simulated CPU devices), `2proc` (`jdp.launch`, 2
processes x 1 device, gloo), `torch` (PyTorch DDP under torchrun, 2 ranks x 1 thread, if
installed), each with glibc's defaults and as `<job>+malloc` with jdp's allocator tuning.
Then interleaved rounds time every (job, variant) for about `target_s` seconds each, then the
HLO and profile requests. Every entry of `TABLES` renders one table from these results (or
measures its own); `report.splice` writes them between BENCHMARKS.md's markers.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import tempfile
import time
from typing import NamedTuple

from benchmarks import harness, jobs, report, zero

HAS_TORCH = importlib.util.find_spec("torch") is not None
# Ratios finer than round-to-round noise: "job:a/b" = a / b, alternated in short bursts.
PAIRED = ["2dev:jdp/hand", "2dev+malloc:jdp/hand", "2dev+malloc:shardmap/jdp",
          "2dev+malloc:maxpool/jdp", "2dev+malloc:global/jdp", "2proc:global/jdp"]


class Settings(NamedTuple):
    rounds: int
    target_s: float          # seconds per timed measurement
    loader_batches: int      # batches per loader measurement
    malloc_scaling: bool     # also run 1/4/8 devices with the tuned allocator
    profile: bool            # trace the 2-device steps for the op-time table
    zero_params: int         # parameters of the ZeRO table's MLP
    zero_devices: tuple      # device counts of the ZeRO table


FULL = Settings(7, 1.0, 200, True, True, 50_000_000, (1, 2, 4, 8))
QUICK = Settings(5, 0.25, 50, False, False, 3_000_000, (1, 2, 4, 8))


def selected(name: str, make):
    """`make` as a table that `--only` leaves out unless it names `name`."""
    def table(r: dict) -> str:
        if r.get("only") and name not in r["only"]:
            return f"Not measured: `--only` did not name `{name}`.\n"
        return make(r)
    table.__doc__ = make.__doc__
    return table


def input_pipeline(r: dict) -> str:
    """The input-pipeline table: `benchmarks/bench_input.py`'s `table() -> str`, if there."""
    try:
        table = getattr(importlib.import_module("benchmarks.bench_input"), "table", None)
    except ModuleNotFoundError as e:
        if e.name != "benchmarks.bench_input":
            raise
        table = None
    return table() if table else "Skipped: no `table()` in benchmarks/bench_input.py yet.\n"


TABLES = [
    ("Summary", report.summary),
    ("1. jdp's step (pmap and shard_map backends) against a hand-written pmap step, "
     "1 process x 2 devices", report.overhead),
    ("1b. Alternated in-process: ratios finer than the rounds", report.paired),
    ("2. Scaling over simulated CPU devices (one process, 64 examples per device)",
     report.scaling),
    ("3. Loader throughput against the train step", report.loader),
    ("4. Two processes (jdp.launch, gloo) against one process with two devices",
     report.processes),
    ("5. PyTorch DDP on the same machine (global batch 128)", report.versus_torch),
    ("6. All-reduce traffic per step (compiled HLO)", report.all_reduce),
    ("7. Where the time goes: op time by kind (jax.profiler trace, 5 steps)", report.op_time),
    ("8. Global layout against the pmap layout", report.layouts),
    ("9. Optimizer-state sharding (ZeRO-1): memory, traffic, time", selected("zero", zero.table)),
    ("10. Input pipeline", selected("input", input_pipeline)),
]


def plan(settings: Settings, root: str) -> list[jobs.Job]:
    """The jobs of a run: variants a worker cannot build (no `jdp.broadcast`) it drops."""
    out = []
    for tag, malloc in (("", "default"), ("+malloc", "tuned")):
        for k in (1, 2, 4, 8) if settings.malloc_scaling or not tag else (2,):
            out.append(jobs.jax_job(f"{k}dev{tag}", root, k, ["jdp", "hand", "shardmap",
                                    "maxpool", "global"] if k == 2 else ["jdp"], malloc))
        out.append(jobs.launch_job(f"2proc{tag}", root, ["jdp", "global"], malloc))
        if HAS_TORCH:
            out.append(jobs.torch_job(f"torch{tag}", root, malloc))
    return out


def _measure(workers: dict, settings: Settings, steps: dict, details: dict):
    """`measure(key) -> samples/s or ratio` for `harness.interleave`; answers go to `details`."""
    def measure(key: str) -> float:
        job, variant = key.split(":")
        if "/" in variant:
            a, b = variant.split("/")
            res = workers[job].request(op="paired", a=a, b=b, reps=6,
                                       steps=max(2, steps[f"{job}:{a}"] // 3))
        elif variant == "loader":
            res = workers[job].request(op="loader", batch_size=128,
                                       num_batches=settings.loader_batches)
        else:
            res = workers[job].request(op="time", variant=variant, steps=steps[key])
        details.setdefault(key, []).append(res)
        return res.get("ratio") or res.get("samples_per_s") or res["samples"] / res["seconds"]
    return measure


def measure(workers: dict, settings: Settings) -> dict:
    """Calibrate, run the interleaved rounds, then the HLO and profile requests. `workers`:
    job name -> `harness.Worker` (or a stand-in with `.info["variants"]` and `.request`)."""
    steps = {}
    for job, w in workers.items():  # about target_s per measurement, at least 3 steps
        for v in w.info["variants"]:
            seconds = w.request(op="time", variant=v, steps=3)["seconds"]
            steps[f"{job}:{v}"] = max(3, round(settings.target_s * 3 / seconds))
    keys = [*steps, *(k for k in PAIRED if {k.split("/")[0], k.split(":")[0] + ":" +
                                              k.split("/")[1]} <= steps.keys())]
    if "2dev:jdp" in steps:
        keys.insert(1, "2dev:loader")
    details: dict = {}
    samples = harness.interleave(_measure(workers, settings, steps, details), keys,
                                 settings.rounds)

    def ask(op: str, names: tuple, **extra) -> dict:
        return {k: workers[k.split(":")[0]].request(op=op, variant=k.split(":")[1], **extra)
                for k in names if k in steps}

    return {"samples": samples, "details": details,
            "hlo": ask("hlo", ("2dev:jdp", "2dev:shardmap", "2dev:maxpool", "2dev:global",
                               "2proc:jdp", "2proc:global")),
            "profile": ask("profile", ("2dev:jdp", "2dev+malloc:jdp", "2dev+malloc:maxpool")
                           if settings.profile else (), steps=5)}


def run(settings: Settings, only: list[str]) -> dict:
    """Start the jobs (all, or those named in `only`), measure, stop them: the results."""
    notes = [] if HAS_TORCH else [
        "torch is not installed: no PyTorch DDP rows (pip install torch==2.13.0, CPU build)"]
    r = {"settings": settings._asdict(), "generated": time.strftime("%Y-%m-%d %H:%M"), "only": only,
         "load_before": os.getloadavg(), "notes": notes, "started": time.time()}
    shown = ("XLA_FLAGS", "OMP_NUM_THREADS", "JDP_MALLOC_TUNING", *jobs.MALLOC_ENV)
    with tempfile.TemporaryDirectory(prefix="jdp-bench-") as root:
        job_list = [j for j in plan(settings, root) if not only or j.name in only]
        r["commands"] = {j.name: " ".join([*(f"{k}={j.env[k]}" for k in shown if k in j.env),
                                           "python", *j.argv[1:]]).replace(root, "$DIR")
                         for j in job_list}
        workers = {j.name: harness.Worker(j.name, j.argv, j.env, j.control, jobs.REPO)
                   for j in job_list}
        try:
            for name, worker in list(workers.items()):
                try:
                    worker.wait_ready(timeout=600)
                except RuntimeError as e:  # reported; the run goes on without this job
                    notes.append(f"job {name} did not start: {e}")
                    workers.pop(name).stop()
            r.update(measure(workers, settings))
        finally:
            for worker in workers.values():
                worker.stop()
    return r


def render(r: dict) -> str:
    """The generated block: the header, then every table under its title."""
    parts = []
    for title, make in TABLES:
        try:
            parts.append(f"### {title}\n\n{make(r)}")
        except Exception as e:  # one failing table must not lose the whole run
            parts.append(f"### {title}\n\nFailed: {type(e).__name__}: {e}\n")
    r.update(load_after=os.getloadavg(), seconds=time.time() - r["started"])
    return "\n".join([report.header(r), *parts])


def main(argv=None) -> None:
    """Measure, then rewrite the generated block of `--output`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", default="BENCHMARKS.md", help="the file to update")
    p.add_argument("--quick", action="store_true", help="shorter measurements (~3 minutes)")
    p.add_argument("--only", default="", help="comma-separated job names, and `zero` or "
                   "`input` for those tables (default: all)")
    args = p.parse_args(argv)
    r = run(QUICK if args.quick else FULL, [j for j in args.only.split(",") if j])
    r["command"] = " ".join(["python -m benchmarks.run", *(argv or sys.argv[1:])])
    block = render(r)
    old = open(args.output).read() if os.path.exists(args.output) else None
    with open(args.output, "w") as f:
        f.write(report.splice(old, block))
    print(f"wrote {args.output} in {r['seconds']:.0f} s")


if __name__ == "__main__":
    main()
