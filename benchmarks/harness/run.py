"""Run jdp's benchmarks and write their tables into BENCHMARKS.md (what `make bench` runs):
`python -m benchmarks [--output BENCHMARKS.md] [--quick] [--only 2dev+malloc,torch]`.

One long-lived job per configuration (`benchmarks.harness.jobs`): `1dev 2dev 4dev 8dev` (one
process, k simulated devices), `2proc` (`jdp.launch`, 2 processes x 1 device), `torch`
(PyTorch DDP, if installed), each also as `<job>+malloc` with jdp's allocator tuning.
Interleaved rounds time every (job, variant) for about `target_s` s, then come the HLO and
profile requests. Each entry
of `TABLES` renders one table from these results (`benchmarks.cnn`) or calls the module of a
benchmark that measures its own.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time

from benchmarks import cnn, overhead, zero
from benchmarks.harness import control, jobs, report

HAS_TORCH = importlib.util.find_spec("torch") is not None
# Ratios finer than round-to-round noise: "job:a/b" = a / b, alternated in short bursts.
PAIRED = ["2dev:jdp/hand", "2dev+malloc:jdp/hand", "2dev+malloc:maxpool/jdp",
          "2dev+malloc:pmap/jdp", "2proc:pmap/jdp"]


# rounds; seconds per timed measurement; batches per loader measurement; 1/4/8 devices also
# with the tuned allocator; the op-time profile; the ZeRO table's MLP size and device counts.
FULL = dict(rounds=7, target_s=1.0, loader_batches=200, malloc_scaling=True, profile=True,
            zero_params=50_000_000, zero_devices=(1, 2, 4, 8))
QUICK = {**FULL, "rounds": 5, "target_s": 0.25, "loader_batches": 50, "malloc_scaling": False,
         "profile": False, "zero_params": 3_000_000}


def selected(name: str, make):
    """`make` as a table that `--only` leaves out unless it names `name`."""
    return lambda r: (make(r) if not r.get("only") or name in r["only"]
                      else f"Not measured: `--only` did not name `{name}`.\n")


def overhead_table(r: dict) -> str:
    """The host-overhead table, shorter under `--quick`."""
    quick = r["settings"]["rounds"] < FULL["rounds"]
    return overhead.table(reps=7 if quick else 15, steps=100 if quick else 300)


TABLES = [*cnn.TABLES,
          ("9. Sharded training state (ZeRO, FSDP, bf16) against replication: memory at rest "
           "and at peak, traffic, time",
           selected("zero", zero.table)),
          ("10. Input pipeline", selected(
              "input", lambda r: importlib.import_module("benchmarks.bench_input").table())),
          ("11. Host time per step: jdp.train_step against a hand-written jax.jit step "
           "(one device, alternated in one process)", selected("overhead", overhead_table)),
          ("12. How long save() blocks the training loop", selected(
              "checkpoint", lambda r: importlib.import_module(
                  "benchmarks.bench_checkpoint").table())),
          ("13. What the progress records cost a step", selected(
              "progress", lambda r: importlib.import_module("benchmarks.bench_progress").table())),
          ("14. Coordination at scale: requests, bytes and time per agreement point, watchdog "
           "and roll call vs the number of processes", selected(
              "coordination", lambda r: importlib.import_module(
                  "benchmarks.bench_coordination").table())),
          ("15. One process per device (jdp.launch 2 x 1) against one process with both devices, "
           "a hand-written jit(shard_map) step and PyTorch DDP (torchrun); where the 2 x 1 step's "
           "time goes", selected("layouts", lambda r: importlib.import_module(
               "benchmarks.layouts").table())),
          ("16. FSDP on an unrolled Transformer (flax lm1b's TransformerLM): one layer at a "
           "time against the gathers left to the compiler, the model scanned, ZeRO and "
           "replicated", selected("zero", lambda r: importlib.import_module(
               "benchmarks.fsdp_unrolled").table(r))),
          ("17. Fault-tolerant replica groups (jdp.ft on torchft): survivors' stall per kill, "
           "heal time of a 50M-parameter state, step time against the same layout without FT, "
           "goodput with a kill at every interval beside restarts from disk checkpoints",
           selected("ft", lambda r: importlib.import_module("benchmarks.ft").table(
               "quick" if r["settings"]["rounds"] < FULL["rounds"] else "full")))]


def measure(workers: dict, settings: dict) -> dict:
    """Calibrate, run the interleaved rounds, then the HLO and profile requests. `workers`:
    job name -> `control.Worker` (or a stand-in with `.info["variants"]` and `.request`)."""
    steps = {}
    for job, w in workers.items():  # about target_s per measurement, at least 3 steps
        for v in w.info["variants"]:
            seconds = w.request(op="time", variant=v, steps=3)["seconds"]
            steps[f"{job}:{v}"] = max(3, round(settings["target_s"] * 3 / seconds))
    keys = [*steps, *(k for k in PAIRED if k.split("/")[0] in steps
                      and k.split(":")[0] + ":" + k.split("/")[1] in steps)]
    if "2dev:jdp" in steps:
        keys.insert(1, "2dev:loader")
    details: dict = {}

    def one(key: str) -> float:  # samples/s, or a paired ratio
        job, variant = key.split(":")
        if "/" in variant:
            a, b = variant.split("/")
            res = workers[job].request(op="paired", a=a, b=b, reps=6,
                                       steps=max(2, steps[f"{job}:{a}"] // 3))
        elif variant == "loader":
            res = workers[job].request(op="loader", batch_size=128,
                                       num_batches=settings["loader_batches"])
        else:
            res = workers[job].request(op="time", variant=variant, steps=steps[key])
        details.setdefault(key, []).append(res)
        return res.get("ratio") or res.get("samples_per_s") or res["samples"] / res["seconds"]

    def ask(op: str, keys: tuple, **extra) -> dict:
        return {k: workers[k.split(":")[0]].request(op=op, variant=k.split(":")[1], **extra)
                for k in keys if k in steps}

    samples = control.interleave(one, keys, settings["rounds"])
    profiled = ("2dev:jdp", "2dev+malloc:jdp", "2dev+malloc:maxpool")
    return {"samples": samples, "details": details,
            "profile": ask("profile", profiled if settings["profile"] else (), steps=5),
            "hlo": ask("hlo", ("2dev:jdp", "2dev:pmap", "2dev:maxpool", "2proc:jdp",
                               "2proc:pmap"))}


def run(settings: dict, only: list[str]) -> dict:
    """Start the jobs (all, or those named in `only`), measure, stop them: the results."""
    notes = [] if HAS_TORCH else [
        "torch is not installed: no PyTorch DDP rows (pip install torch==2.13.0, CPU build)"]
    r = {"settings": settings, "generated": time.strftime("%Y-%m-%d %H:%M"), "only": only,
         "load_before": os.getloadavg(), "notes": notes, "started": time.time()}
    with tempfile.TemporaryDirectory(prefix="jdp-bench-") as root:
        todo = [j for j in jobs.plan(root, settings["malloc_scaling"], HAS_TORCH)
                if not only or j.name in only]
        r["commands"] = {j.name: jobs.command_line(j).replace(root, "$DIR") for j in todo}
        workers = {j.name: control.Worker(j.name, j.argv, j.env, j.control, jobs.REPO)
                   for j in todo}
        try:
            for name in list(workers):
                try:
                    workers[name].wait_ready(timeout=600)
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
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument("--output", default="BENCHMARKS.md", help="the file to update")
    p.add_argument("--quick", action="store_true",
                   help="shorter measurements (~5 minutes; ~15 with the ft extra)")
    p.add_argument("--only", default="", help="comma-separated job names, and `zero`, "
                   "`input`, `overhead`, `checkpoint`, `progress`, `coordination`, `layouts` or "
                   "`ft` for those tables "
                   "(default: all)")
    args = p.parse_args(argv)
    r = run(QUICK if args.quick else FULL, [j for j in args.only.split(",") if j])
    r["command"] = " ".join(["python -m benchmarks", *(argv or sys.argv[1:])])
    block = render(r)
    old = open(args.output).read() if os.path.exists(args.output) else None
    with open(args.output, "w") as f:
        f.write(report.splice(old, block))
    print(f"wrote {args.output} in {r['seconds']:.0f} s")


if __name__ == "__main__":
    main()
