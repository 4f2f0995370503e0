"""One process per device against one process with all devices, and PyTorch DDP under torchrun.

    python -m benchmarks.layouts [--rounds 5] [--target_s 1.0]      # the table, as markdown

The seed CNN as users write it (`examples/mnist.py` with flax's `nn.max_pool`, BatchNorm),
SGD momentum, 64 examples per device, global batch 128, in long-lived jobs timed in
interleaved rounds (`benchmarks.harness`): PyTorch DDP (torchrun, 2 ranks, gloo),
jdp with 1 process x 2 devices, jdp.launch with 2 processes x 1 device (as launched, and with
the settings tried below), and a hand-written `jax.jit(shard_map)` step in the same 2
processes (the floor for jdp: JAX's own step, no jdp code). A profile of the 2 x 1 step on
both ranks then splits it (`breakdown`): compute (XLA ops running), collective (the
all-reduce on the rank that arrives last: the transfer itself), wait (the rest of the
all-reduce: waiting for the other rank) and host (the step's remaining wall time: dispatch,
Python, threads waking up).

Worker side: `python -m benchmarks.layouts worker CONTROL VARIANTS` (`jdp`, `hand`).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks import harness
from benchmarks.harness import jobs, report

PROFILE_STEPS = 8


# --- worker side (imports JAX) -------------------------------------------------------------

def hand_step(loss_fn):
    """jdp's work written by hand as one `jax.jit(shard_map)`: gradients, BatchNorm statistics
    and metrics averaged over the devices, donated state."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jdp
    from benchmarks import worker
    mapped = jax.shard_map(worker.hand_device_step(loss_fn), mesh=jdp.mesh(),
                           in_specs=(P(), P(jdp.AXIS)), out_specs=(P(), P()))
    return jax.jit(mapped, donate_argnums=0)


def build(name: str):
    """A variant's step, placed state and fixed batch (the `nn.max_pool` CNN)."""
    from benchmarks import worker
    v = worker.build("maxpool", 64)
    if name == "hand":
        v = v._replace(step=hand_step(worker.example(max_pool=True).loss_fn))
    return v


class Bench:
    """This rank's variants; answers "time" and "profile" requests (`benchmarks.harness`)."""

    def __init__(self, control: str, names: list[str]):
        import jax
        self.control, self.global_batch = control, 64 * jax.device_count()
        self.variants = {n: build(n) for n in names}
        for name in names:
            self._run(name, 3)

    def _run(self, name: str, steps: int, annotate: bool = False) -> None:
        """`steps` steps as a training loop runs them (at most 2 queued); with `annotate`,
        each in its own `train` step annotation and waited for, so a profile tells them
        apart."""
        import jax
        v, pending = self.variants[name], []
        state = v.state
        for k in range(steps):
            if annotate:
                with jax.profiler.StepTraceAnnotation("train", step_num=k):
                    state, metrics = v.step(state, v.batch)
                    jax.block_until_ready(metrics)
                continue
            state, metrics = v.step(state, v.batch)
            pending.append(metrics)
            if len(pending) > 2:
                jax.block_until_ready(pending.pop(0))
        self.variants[name] = v._replace(state=jax.block_until_ready((state, pending))[0])

    def time(self, request: dict) -> dict:
        self._run(request["variant"], 1)
        return harness.timed(lambda: self._run(request["variant"], request["steps"]),
                             request["steps"], self.global_batch)

    def profile(self, request: dict) -> dict:
        """Trace `steps` steps on every rank; each rank leaves its per-step figures in the
        control directory; rank 0 combines them (`breakdown`)."""
        import jax
        rank, name = jax.process_index(), request["variant"]
        self._run(name, 1)
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir):
                self._run(name, request["steps"], annotate=True)
            steps = step_figures(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
        mine = os.path.join(self.control, f"profile.{request['k']}.{rank}")
        harness.write_json(mine, steps)
        if rank != 0:
            return {}
        ranks = [harness._wait_for(os.path.join(self.control, f"profile.{request['k']}.{r}"), 60)
                 for r in range(jax.process_count())]
        return breakdown(ranks)


def step_figures(xplane: str) -> list[dict]:
    """Per traced step of one rank: its wall time, the time any XLA op other than the
    all-reduce ran, and the all-reduce's duration (milliseconds)."""
    from jax.profiler import ProfileData
    steps, ops = [], []
    for plane in ProfileData.from_file(xplane).planes:
        for line in plane.lines:
            for e in line.events:
                if e.name == "train":
                    steps.append((e.start_ns, e.start_ns + e.duration_ns))
                elif line.name != "python" and not e.name.startswith(("ThunkExecutor", "Thunk")):
                    ops.append((e.start_ns, e.start_ns + e.duration_ns, e.name))
    out = []
    for start, end in sorted(steps):
        mine = [(a, b, n) for a, b, n in ops if start <= a < end]
        reduce = sum(b - a for a, b, n in mine if n.startswith("all-reduce"))
        compute = _union([(a, b) for a, b, n in mine if not n.startswith("all-reduce")])
        out.append({"wall": (end - start) / 1e6, "compute": compute / 1e6,
                    "all_reduce": reduce / 1e6})
    return out


def _union(intervals: list) -> float:
    """Length of the union of (start, end) intervals."""
    total, reach = 0, None
    for a, b in sorted(intervals):
        if reach is None or a > reach:
            total, reach = total + b - a, b
        elif b > reach:
            total, reach = total + b - reach, b
    return total


def breakdown(ranks: list[list[dict]]) -> dict:
    """Mean milliseconds per step over steps and ranks (so the parts add up to the wall time):
    compute, collective (the all-reduce of the rank arriving last, i.e. the shortest), wait
    (the rest of this rank's all-reduce) and host (the rest of the step's wall time)."""
    rows = []
    for k in range(min(map(len, ranks))):
        collective = min(r[k]["all_reduce"] for r in ranks)
        for r in ranks:
            s = r[k]
            rows.append({"wall": s["wall"], "compute": s["compute"], "collective": collective,
                         "wait": s["all_reduce"] - collective,
                         "host": s["wall"] - s["compute"] - s["all_reduce"]})
    return {key: statistics.mean(x[key] for x in rows) for key in rows[0]}


def worker_main(control: str, names: str) -> None:
    import jax

    import jdp
    jdp.initialize()
    bench = Bench(control, names.split(","))
    harness.serve(control, {"time": bench.time, "profile": bench.profile},
                  primary=jax.process_index() == 0, info={"variants": list(bench.variants)})


# --- parent side (no JAX) ------------------------------------------------------------------

def plan(root: str, torch: bool, settings: dict) -> list[jobs.Job]:
    """The jobs: torch DDP, jdp 1 x 2, jdp.launch 2 x 1 as launched, and 2 x 1 under each of
    `settings` (name -> environment), all with jdp's allocator settings but torch."""
    worker = [sys.executable, "-m", "benchmarks.layouts", "worker"]

    def launch(name: str, env: dict, variants: str) -> jobs.Job:
        control = os.path.join(root, name)
        argv = [sys.executable, "-m", "jdp.launch", "--nproc_per_node", "2",
                "--devices_per_process", "1", "--master_port", str(jobs.free_port()),
                *worker[1:], control, variants]
        return jobs.Job(name, control, argv, jobs.base_env("tuned", **env))
    out = [jobs.job("torch", root, "torch", "default")] if torch else []
    control = os.path.join(root, "1x2")
    out.append(jobs.Job("1x2", control, [*worker, control, "jdp"],
                        jobs.base_env("tuned", XLA_FLAGS=jobs.device_flags(2))))
    out.append(launch("2x1", {}, "jdp,hand"))
    out += [launch(f"2x1 {name}", env, "jdp") for name, env in settings.items()]
    return out


def measure(workers: dict, rounds: int, target_s: float) -> dict:
    """Interleaved rounds of "time" requests; then a profile of each 2 x 1 job's steps.
    Returns {"ms": key -> [ms per step per round], "cpu": key -> [rank 0's CPU ms per step],
    "profile": key -> breakdown}."""
    keys, steps = [], {}
    for job, w in workers.items():
        for v in w.info["variants"]:
            seconds = w.request(op="time", variant=v, steps=3)["seconds"]
            keys.append(f"{job}:{v}")
            steps[keys[-1]] = max(3, round(target_s * 3 / seconds))

    cpu: dict = {}

    def one(key: str) -> float:
        job, variant = key.split(":")
        res = workers[job].request(op="time", variant=variant, steps=steps[key])
        cpu.setdefault(key, []).append(res["user_ms_per_step"] + res["sys_ms_per_step"])
        return res["seconds"] * 1e3 / steps[key]
    ms = harness.interleave(one, keys, rounds)
    profile = {key: workers[key.split(":")[0]].request(
        op="profile", variant=key.split(":")[1], steps=PROFILE_STEPS, k=key.replace(":", "."))
        for key in keys if key.startswith("2x1")}
    return {"ms": ms, "cpu": cpu, "profile": profile}


def render(r: dict) -> str:
    """The side-by-side table, the 2 x 1 breakdown and the jobs' commands, as markdown."""
    ms, base = r["ms"], "torch:ddp"

    def vs_torch(key: str) -> str:
        if base not in ms:
            return "n/a"
        return report.fmt(statistics.median(t / m for t, m in zip(ms[base], ms[key],
                                                                   strict=True)))
    rows = [[f"`{k}`", r["labels"].get(k, ""), report.fmt(statistics.median(v), 1),
             report.spread(v), report.fmt(128 * 1e3 / statistics.median(v), 0), vs_torch(k),
             report.fmt(statistics.median(r["cpu"][k]), 1)]
            for k, v in ms.items()]
    out = report.table(["job:variant", "what", "ms / step (median)", "min–max",
                        "samples/s", "samples/s vs torch DDP (per-round median)",
                        "rank 0 CPU ms / step"], rows)
    parts = ["compute", "collective", "wait", "host", "wall"]
    prof = [[f"`{key}`", *(report.fmt(p[k], 1) for k in parts)]
            for key, p in r["profile"].items()]
    hook = (f"\nThe `--profile_steps` hook, off: {r['hook_us']:.2f} µs per train step call "
            f"(`benchmarks.layouts.hook_cost`).\n\nJobs:\n\n")
    commands = "".join(f"- `{name}`: `{cmd}`\n" for name, cmd in r["commands"].items())
    return out + "\n" + report.table(["2 x 1 step, ms (mean of 8 steps and both ranks)",
                                      *parts], prof) + hook + commands


LABELS = {"torch:ddp": "PyTorch DDP, torchrun 2 x 1 thread, gloo",
          "1x2:jdp": "jdp, 1 process x 2 devices",
          "2x1:jdp": "jdp.launch, 2 processes x 1 device",
          "2x1:hand": "hand-written jit(shard_map), same 2 processes"}


def run(rounds: int = 5, target_s: float = 1.0, settings: dict | None = None,
        only: list | None = None) -> dict:
    """Start the jobs (those named in `only`, default all), measure, stop them; the results
    for `render`."""
    import importlib.util
    torch = importlib.util.find_spec("torch") is not None
    settings = SETTINGS if settings is None else settings
    with tempfile.TemporaryDirectory(prefix="jdp-layouts-") as root:
        todo = [j for j in plan(root, torch, settings) if not only or j.name in only]
        workers = {j.name: harness.Worker(j.name, j.argv, j.env, j.control, jobs.REPO)
                   for j in todo}
        try:
            for w in workers.values():
                w.wait_ready(timeout=900)
            r = measure(workers, rounds, target_s)
        finally:
            for w in workers.values():
                w.stop()
    labels = {**LABELS, **{f"2x1 {n}:jdp": "2 x 1 with " + " ".join(
        f"{k}={v}" for k, v in e.items()) for n, e in settings.items()}}
    extra = {f"2x1 {n}": " ".join(f"{k}={v}" for k, v in e.items() if k != "XLA_FLAGS") + " "
             for n, e in settings.items()}
    commands = {j.name: (extra.get(j.name, "") + jobs.command_line(j)).strip().replace(root, "$DIR")
                for j in todo}
    return {**r, "labels": labels, "commands": commands,
            "hook_us": hook_cost()}


def hook_cost(calls: int = 200_000) -> float:
    """Microseconds per call of the profile hook every jdp train step makes, with no profile
    asked (`--profile_steps` off): what the option costs a step when it is off."""
    from jdp.metrics import profile as _profile
    if _profile.window_from_env() is not None:
        raise RuntimeError(f"unset {_profile.STEPS} to measure the hook with profiling off")
    start = time.perf_counter()
    for n in range(1, calls + 1):
        _profile.before_step(n)
    return (time.perf_counter() - start) / calls * 1e6


# The 2 x 1 settings compared with the launch as it is (name -> environment of the launch):
# XLA:CPU's thread pools sized 1 per process (PJRT_NPROC, read by jaxlib's CPU client), and
# Eigen's intra-op threading off.
SETTINGS: dict = {"nproc1": {"PJRT_NPROC": "1"},
                  "noeigen": {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}}


def table(rounds: int = 9, target_s: float = 1.5) -> str:
    """`make bench`'s table 14: run every job, render."""
    return render(run(rounds, target_s))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--target_s", type=float, default=1.0)
    p.add_argument("--only", default="", help="comma-separated job names (default: all)")
    p.add_argument("--setting", action="append", default=[], metavar="NAME:VAR=V[,VAR=V]",
                   help="also run 2 x 1 with these environment variables")
    args = p.parse_args(argv)
    settings = None if not args.setting else {}
    for s in args.setting:
        name, _, assigns = s.partition(":")
        settings[name] = dict(a.split("=", 1) for a in assigns.split(","))
    r = run(args.rounds, args.target_s, settings, [j for j in args.only.split(",") if j])
    print(json.dumps({k: r[k] for k in ("ms", "cpu", "profile")}, indent=1), file=sys.stderr)
    print(render(r))


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker_main(sys.argv[2], sys.argv[3])
    else:
        main()
