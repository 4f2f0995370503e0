"""Run jdp's benchmark suite and write BENCHMARKS.md: `python -m benchmarks.run --output
BENCHMARKS.md [--quick]` (what `make bench` runs).

One job per configuration, all started up front and kept alive (`benchmarks.protocol`):

    1dev 2dev 4dev 8dev         one process, k simulated CPU devices, 64 examples per device
    2proc                       `python -m jdp.launch --nproc_per_node 2`, 1 device each (gloo)
    torch                       PyTorch DDP, torchrun, 2 ranks x 1 thread, gloo (if installed)
    <job>+malloc                the same with `jdp._malloc.tune()` applied

Then `rounds` interleaved rounds time every (job, variant) pair for about `target_s` seconds
each, forward order in even rounds and reversed in odd ones; the loader runs in the same rounds
inside the 2-device job. Afterwards: the all-reduce count and bytes from the compiled HLO, an
op-time profile of the 2-device step, and the gradient check against float64 (in parallel, in
its own process).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

from benchmarks import jobs, loader, protocol, report, timing

PER_DEVICE = 64
# In-process comparisons finer than round-to-round noise: "job:a/b" = throughput a / b.
PAIRED = ["2dev:jdp/hand", "2dev+malloc:jdp/hand", "2dev+malloc:shardmap/jdp",
          "2dev:jdp_nobias_scaleshift/jdp", "2dev+malloc:jdp_nobias_scaleshift/jdp"]


class Settings(NamedTuple):
    rounds: int
    target_s: float          # seconds per timed measurement
    loader_batches: int      # batches per loader measurement
    malloc_scaling: bool     # also run 1/4/8 devices with the tuned allocator
    profile: bool            # trace the 2-device steps for the op-time breakdown


FULL = Settings(rounds=7, target_s=1.0, loader_batches=200, malloc_scaling=True, profile=True)
QUICK = Settings(rounds=5, target_s=0.25, loader_batches=50, malloc_scaling=False,
                 profile=False)


def plan(settings: Settings, root: str, with_torch: bool) -> list[jobs.Job]:
    """The jobs of this run; variants per job are in `variants_of`."""
    out = []
    for tag, malloc in (("", "default"), ("+malloc", "tuned")):
        for k in (1, 2, 4, 8):
            if tag and k != 2 and not settings.malloc_scaling:
                continue
            name = f"{k}dev{tag}"
            out.append(jobs.jax_job(name, os.path.join(root, name), k,
                                    variants_of(name), PER_DEVICE, malloc))
        out.append(jobs.launch_job(f"2proc{tag}", os.path.join(root, f"2proc{tag}"), 2, 1,
                                   ["jdp"], PER_DEVICE, malloc))
        if with_torch:
            out.append(jobs.torch_job(f"torch{tag}", os.path.join(root, f"torch{tag}"), 2,
                                      PER_DEVICE, threads=1, malloc=malloc))
    return out


def variants_of(job: str) -> list[str]:
    """Step variants timed in a job: the 2-device jobs also hold the comparisons."""
    if job == "2dev":
        return ["jdp", "hand", "shardmap", "jdp_nobias_scaleshift"]
    if job == "2dev+malloc":
        return ["jdp", "hand", "shardmap", "jdp_nobias_scaleshift"]
    return ["ddp"] if job.startswith("torch") else ["jdp"]


def start(job_list: list[jobs.Job], notes: list[str]) -> dict[str, protocol.Worker]:
    """Start every job, wait until each has compiled; a job that fails is dropped (noted)."""
    workers = {j.name: protocol.Worker(j.name, j.argv, j.env, j.control, jobs.REPO)
               for j in job_list}
    for name, worker in list(workers.items()):
        try:
            worker.wait_ready(timeout=600)
        except RuntimeError as e:
            notes.append(f"job {name} did not start: {e}")
            worker.stop()
            del workers[name]
    return workers


def _measure_fn(workers, settings: Settings, steps: dict, details: dict):
    """`measure(key) -> samples/s` for `timing.interleave`; keeps each answer in `details`."""
    def measure(key: str) -> float:
        job, variant = key.split(":")
        if "/" in variant:  # a paired ratio: the two variants alternated in short bursts
            a, b = variant.split("/")
            result = workers[job].request(op="paired", a=a, b=b, reps=6,
                                          steps=max(2, steps[f"{job}:{a}"] // 3))
            rate = result["ratio"]
        elif variant == "loader":
            result = workers[job].request(op="loader", batch_size=PER_DEVICE * 2,
                                          num_batches=settings.loader_batches)
            rate = result["samples_per_s"]
        else:
            result = workers[job].request(op="time", variant=variant, steps=steps[key])
            rate = result["samples"] / result["seconds"]
        details.setdefault(key, []).append(result)
        return rate
    return measure


def calibrate(workers, keys: list[str], target_s: float) -> dict[str, int]:
    """Steps per measurement so that each takes about `target_s` (at least 3 steps)."""
    steps = {}
    for key in keys:
        job, variant = key.split(":")
        if variant != "loader" and "/" not in variant:
            result = workers[job].request(op="time", variant=variant, steps=3)
            steps[key] = max(3, round(target_s * 3 / result["seconds"]))
    return steps


def extras(workers, notes: list[str], profile: bool) -> dict:
    """HLO all-reduce figures and op-time profiles (after the timed rounds)."""
    out: dict = {"hlo": {}, "profile": {}}
    for job, variant in (("2dev", "jdp"), ("2dev", "shardmap"), ("2proc", "jdp"),
                         ("2dev", "jdp_nobias_scaleshift")):
        if job in workers:
            out["hlo"][f"{job}:{variant}"] = workers[job].request(op="hlo", variant=variant)
    for job, variant in (("2dev", "jdp"), ("2dev+malloc", "jdp"),
                         ("2dev", "jdp_nobias_scaleshift")):
        if profile and job in workers:
            try:
                out["profile"][f"{job}:{variant}"] = workers[job].request(
                    op="profile", variant=variant, steps=5)
            except RuntimeError as e:
                notes.append(f"profile of {job}:{variant} unavailable: {e}")
    return out


def describe(job: jobs.Job, root: str) -> str:
    """A job's command line with the environment variables the suite sets for it."""
    env = " ".join(f"{k}={job.env[k]}" for k in ("XLA_FLAGS", "OMP_NUM_THREADS",
                                                  "JDP_MALLOC_TUNING") if k in job.env)
    argv = " ".join(["python", *job.argv[1:]]).replace(root, "$DIR")
    return f"{env} {argv}".strip()


def gradcheck_process() -> subprocess.Popen:
    """`python -m benchmarks.gradcheck` in the background (1 device, not timed)."""
    env = jobs.base_env(XLA_FLAGS=jobs.device_flags(1))
    return subprocess.Popen([sys.executable, "-m", "benchmarks.gradcheck"], env=env,
                            cwd=jobs.REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def run(settings: Settings) -> dict:
    """The whole suite; returns everything `report.render` needs."""
    notes: list[str] = []
    with_torch = jobs.torch_available()
    if not with_torch:
        notes.append("torch is not installed: the PyTorch DDP comparison is skipped "
                     "(pip install torch==2.13.0, the CPU build)")
    started = time.time()
    generated = time.strftime("%Y-%m-%d %H:%M")
    load_before = os.getloadavg()
    checker = gradcheck_process()
    with tempfile.TemporaryDirectory(prefix="jdp-bench-") as root:
        job_list = plan(settings, root, with_torch)
        commands = {j.name: describe(j, root) for j in job_list}
        workers = start(job_list, notes)
        try:
            keys = [f"{name}:{v}" for name in workers for v in variants_of(name)]
            keys += [k for k in PAIRED if k.split(":")[0] in workers]
            why_not = loader.available()
            if why_not is None and "2dev" in workers:
                keys.insert(2, "2dev:loader")
            else:
                notes.append(f"loader benchmark skipped: {why_not or 'no 2dev job'}")
            steps = calibrate(workers, keys, settings.target_s)
            details: dict = {}
            samples = timing.interleave(_measure_fn(workers, settings, steps, details), keys,
                                        settings.rounds)
            more = extras(workers, notes, settings.profile)
            infos = {name: w.info for name, w in workers.items()}
        finally:
            for worker in workers.values():
                worker.stop()
    out, err = checker.communicate(timeout=600)
    gradcheck = json.loads(out) if checker.returncode == 0 else {"error": err[-2000:]}
    return {"settings": settings._asdict(), "samples": samples, "details": details,
            "commands": commands, "generated": generated,
            "steps": steps, "jobs": infos, "gradcheck": gradcheck, "notes": notes,
            "load_before": load_before, "load_after": os.getloadavg(),
            "seconds": time.time() - started, **more}


def main(argv=None) -> None:
    """Measure (or re-render saved results) and write the report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", default="BENCHMARKS.md", help="the report to write")
    p.add_argument("--quick", action="store_true", help="shorter measurements (~2 minutes)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="measure nothing: rewrite the report from results saved with --json")
    args = p.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            results = json.load(f)
    else:
        results = run(QUICK if args.quick else FULL)
        results["command"] = "python -m benchmarks.run --output BENCHMARKS.md" + (
            " --quick" if args.quick else "")
    if args.json and not args.render:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    with open(args.output, "w") as f:
        f.write(report.render(results))
    print(f"wrote {args.output} in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
