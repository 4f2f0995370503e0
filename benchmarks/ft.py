"""Fault-tolerant replica groups (`jdp.ft`, on torchft) under real launchers: the survivors'
stall per kill, the heal time of a large state, the step time against the same layout without
FT, and goodput with a kill at every interval beside restarts from disk checkpoints.

    python -m benchmarks.ft [--size tiny|quick|full] [--parts heal,step,goodput,churn,exchange]
                            [--duration S --every S]     # the tables, as markdown

An FT job is 3 replica groups, each `python -m jdp.launch --nproc_per_node 1
--devices_per_process 2 --max_restarts K --logdir DIR/gG --replica_group G --replica_groups 3`
with `examples/fault_tolerant.py` (or `benchmarks.ft_heal`); group 0 starts the Lighthouse
(`--ft_lighthouse start:PORT`, a free port), the others join it. The plain job is one
`python -m jdp.launch --nproc_per_node 3 --devices_per_process 2 -m benchmarks.ft_plain`: the
same model, per-process batch (16) and Adam, without replica groups. A kill is SIGKILL of one
group's worker (its pid from the group's latest join event), or of one rank of the plain job,
once the victim has made a step since it (re)started (`benchmarks.ft_jobs` starts, kills
and stops the jobs). Figures come from the events files (`jdp.launch._ft`'s format for FT;
`benchmarks.ft_plain`'s for the plain job).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.ft_jobs import (
    GROUPS,
    Job,
    finish,
    ft_job,
    kill_schedule,
    plain_job,
    step_at,
    steps_of,
    stop,
    victim_pid,
    wait_for,
)
from benchmarks.harness import report
from jdp.job.events import read

WARM, SYNC, CHECKPOINT_EVERY = 20, 10, 100
HEAL_WAIT_S = 120   # after the window, the longest a killed group's heal is waited for
BIG_WIDTH = 65_536   # the example's MLP with 18 x 65,536 + 1 = 1.2M parameters
# duration/every: the goodput runs' seconds and kill interval; steps, repeats, widths: the
# step-time runs; heal_params: the heal benchmark's state; churn: rounds of two kills, the
# second at the first group's return.
SIZES = {
    "tiny": dict(duration=20, every=10, steps=60, repeats=1, widths=(64,),
                 heal_params=1_000_000, churn=1, exchange_params=1_000_000, far_steps=40),
    "quick": dict(duration=60, every=15, steps=200, repeats=2, widths=(BIG_WIDTH, 64),
                  heal_params=50_000_000, churn=8, exchange_params=10_000_000,
                  far_steps=200),
    "full": dict(duration=600, every=60, steps=400, repeats=3, widths=(BIG_WIDTH, 64),
                 heal_params=50_000_000, churn=20, exchange_params=10_000_000,
                 far_steps=1000)}
EXCHANGE_DEVICES = (2, 8)   # a group's process as in the FT jobs, and a GPU node's count


def stall_of(events: list, group: int, at: float) -> tuple:
    """The survivors' stall when `group` was killed at time `at`, from the groups' `events`:
    from the kill to the first commit by another group of a group set without the killed
    group, or, when the group came back before the survivors committed (they waited for it),
    to their first commit after its heal. `(stall_s or None, waited, the heal event or None)`
    (the churn test bounds the same figure)."""
    heals = [e for e in events[group] if e["event"] == "heal" and e["time"] > at]
    back = heals[0]["time"] if heals else float("inf")
    commits = [e["time"] for s, ev in enumerate(events) if s != group for e in ev
               if e["event"] == "commit" and e["time"] > at
               and (group not in e["groups"] or e["time"] >= back)]
    first = min(commits, default=None)
    return (None if first is None else first - at, first is not None and first >= back,
            heals[0] if heals else None)


def stalls(job: Job, kills: list) -> list:
    """Per kill of a group: `stall_of`'s stall and whether the survivors waited for the
    group's return; the returning group's heal time (its heal event's seconds). None where
    none came."""
    events = [read(path) for path in job.events]
    out = []
    for kill in kills:
        stall, waited, heal = stall_of(events, kill["victim"], kill["time"])
        out.append({**kill, "stall_s": stall, "waited": waited,
                    "heal_s": heal["seconds"] if heal else None,
                    "heal_step": heal["step"] if heal else None})
    return out


def work(job: Job, start: float, end: float) -> tuple[int, float]:
    """(steps, full-batch steps) made in (start, end]: a step of the FT job with g of the 3
    groups counts g / 3 of a full batch (its global batch is g x 16 examples); every step of
    the plain job is a full batch."""
    steps = steps_of(job)
    made = step_at(steps, end) - step_at(steps, start)
    first: dict = {}
    for path in job.events:
        for e in read(path):
            if e["event"] == "commit" and e["step"] not in first:
                first[e["step"]] = (e["time"], len(e["groups"]))
            elif e["event"] == "commit":
                first[e["step"]] = min(first[e["step"]], (e["time"], len(e["groups"])))
    if not first:
        return made, float(made)
    return made, sum(g for t, g in first.values() if start < t <= end) / GROUPS


def goodput_run(make, root: str, size: dict, kill: bool, seed: int = 0) -> dict:
    """One job for `duration` s after its step WARM, killed every `every` s (or never):
    {"steps", "batches": what `work` made in that window, "kills": [...]}."""
    job = make(root)
    try:
        start = wait_for(lambda: next((t for t, s in steps_of(job) if s >= WARM), None), 600,
                      f"step {WARM}")
        kills = (kill_schedule(job, start, size["duration"], size["every"], random.Random(seed))
                 if kill else [])
        time.sleep(max(0.0, start + size["duration"] - time.time()) + 1.0)
        steps, batches = work(job, start, start + size["duration"])
        return {"steps": steps, "batches": batches,
                "kills": healed(job, kills) if len(job.events) > 1 and kills else kills}
    finally:
        stop(job)


def healed(job: Job, kills: list) -> list:
    """`stalls(job, kills)` once every killed group has healed (a group killed late in the
    window heals after it), or as they are after HEAL_WAIT_S: a group that did not come back
    keeps no heal ("none")."""
    def rows():
        found = stalls(job, kills)
        return found if all(k["heal_s"] is not None for k in found) else None
    try:
        return wait_for(rows, HEAL_WAIT_S, "heal of every killed group")
    except TimeoutError:
        return stalls(job, kills)


def goodput(root: str, size: dict) -> dict:
    """FT and plain-with-checkpoints, each without and then with kills: steps and full-batch
    steps made in the window; goodput = made with kills / made without kills in as long."""
    restarts = size["duration"] // size["every"] + 2
    example = ["examples/fault_tolerant.py", "--steps", "100000000"]
    makes = {"ft": lambda d: ft_job(d, example, restarts),
             "plain": lambda d: plain_job(d, ["--steps", "100000000", "--sync_every", str(SYNC),
                                              "--checkpoint_dir", os.path.join(d, "ckpt"),
                                              "--every", str(CHECKPOINT_EVERY)], restarts)}
    out = {}
    for name, make in makes.items():
        clean, killed = (goodput_run(make, os.path.join(root, f"{name}-{kill}"), size, kill)
                         for kill in (False, True))
        out[name] = {"clean": clean["steps"], "killed": killed["steps"],
                     "kills": killed["kills"],
                     "goodput": killed["steps"] / max(clean["steps"], 1),
                     "batches": killed["batches"] / max(clean["batches"], 1)}
    return out


def heal(root: str, params: int) -> dict:
    """Kill group 1 of a `benchmarks.ft_heal` job with `params` parameters once it is steady:
    its heal event's seconds, and the stall of the survivors."""
    job = ft_job(root, ["-m", "benchmarks.ft_heal", "--params", str(params)], restarts=2)
    try:
        wait_for(lambda: sum(e["event"] == "commit" for e in read(job.events[1])) >= 5, 600,
              "5 steps of the heal job")
        pid = victim_pid(job, 1)
        os.kill(pid, signal.SIGKILL)
        kill = {"victim": 1, "time": time.time(), "pid": pid}
        wait_for(lambda: [e for e in read(job.events[1]) if e["event"] == "heal"], 600, "heal")
        (result,) = stalls(job, [kill])
        place = next(e["place_s"] for e in read(job.events[1]) if e["event"] == "heal")
        return {**result, "place_s": place, "bytes": params // 4 * 4 * 4}
    finally:
        stop(job)


def step_times(root: str, size: dict) -> list:
    """Per (repeat, width), interleaved: the median seconds per step of the FT job and of the
    plain job, over windows of SYNC steps after step WARM."""
    out = []
    for rep in range(size["repeats"]):
        for width in size["widths"]:
            common = ["--steps", str(size["steps"]), "--width", str(width)]
            ft = ft_job(os.path.join(root, f"ft-{rep}-{width}"),
                        ["examples/fault_tolerant.py", *common], restarts=0)
            finish(ft, 900)
            plain = plain_job(os.path.join(root, f"plain-{rep}-{width}"),
                              [*common, "--sync_every", str(SYNC)], restarts=0)
            finish(plain, 900)
            out.append({"width": width, "ft": _per_step(Job([], ft.events[:1])),
                        "plain": _per_step(plain)})
    return out


def _per_step(job: Job) -> float:
    steps = [(t, s) for t, s in steps_of(job) if s >= WARM and s % SYNC == 0]
    pairs = zip(steps, steps[1:], strict=False)
    return statistics.median((b[0] - a[0]) / (b[1] - a[1]) for a, b in pairs)


def churn(root: str, size: dict) -> dict:
    """Kills timed at another group's return, `churn` rounds: kill a random group's worker,
    and the moment its launcher's new worker reaches the Lighthouse (its connect event),
    kill another group's (one that has made a step since its own start). {"kills": each
    kill's `stalls` row, with "at" the kill's moment ("any", "rejoin"); "returns":
    `returns`' row per return}."""
    rng = random.Random(0)
    job = ft_job(root, ["examples/fault_tolerant.py", "--steps", "100000000"],
                 2 * size["churn"] + 2)
    kills: list = []
    try:
        for _ in range(size["churn"]):
            first, second = rng.sample(range(GROUPS), 2)
            pids = [_trains(job, g, kills) for g in range(GROUPS)]
            os.kill(pids[first], signal.SIGKILL)
            kills.append({"victim": first, "time": time.time(), "pid": pids[first], "at": "any"})
            wait_for(lambda g=first: _connected(job, g, kills), 300, f"group {first}'s return")
            os.kill(pids[second], signal.SIGKILL)
            kills.append({"victim": second, "time": time.time(), "pid": pids[second],
                          "at": "rejoin"})
        for g in range(GROUPS):
            _trains(job, g, kills)
        return {"kills": stalls(job, kills), "returns": returns(job, kills)}
    finally:
        stop(job)


def returns(job: Job, kills: list, window: float = 10.0) -> list:
    """Per return of a killed group (a join after a kill): the longest gap ending in the
    `window` s after it joined between the commits of a group not restarted around it (the
    5 s before the join give each gap its start): what the others wait while it heals and
    starts training again."""
    events = [read(path) for path in job.events]
    joins = [(e["time"], g) for g, ev in enumerate(events) for e in ev
             if e["event"] == "join" and e.get("restart", 0) > 0]
    out = []
    for at, back in sorted(joins):
        gaps = []
        for g, ev in enumerate(events):
            if g == back or any(at - 5 < e["time"] < at + window for e in ev
                                if e["event"] == "join"):
                continue   # the returning group, or one restarted itself meanwhile
            times = [e["time"] for e in ev if e["event"] == "commit"
                     and at - 5 < e["time"] < at + window]
            gaps += [b - a for a, b in zip(times, times[1:], strict=False) if b > at]
        out.append({"group": back, "gap_s": max(gaps, default=None)})
    return out


def _trains(job: Job, group: int, kills: list) -> int:
    """The pid of the group's worker once one not killed has made a step since it started."""
    dead = {k["pid"] for k in kills}
    return wait_for(lambda: (pid := victim_pid(job, group)) not in dead and pid, 300,
                    f"a step of group {group}")


def _connected(job: Job, group: int, kills: list) -> bool:
    """Has a worker of the group that was not killed reached the Lighthouse (its "connect",
    once its step is compiled: its first quorum follows)?"""
    events = read(job.events[group])
    joins = [e for e in events if e["event"] == "join"]
    return bool(joins) and joins[-1]["pid"] not in {k["pid"] for k in kills} and any(
        e["event"] == "connect" and e["time"] >= joins[-1]["time"] for e in events)


def exchange(params: int) -> list:
    """`benchmarks.ft_exchange` in a process of each of `EXCHANGE_DEVICES` CPU devices: the
    host time of the synchronous exchange per step, jdp.ft's buffers against the reference
    route."""
    out = []
    for devices in EXCHANGE_DEVICES:
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
        done = subprocess.run([sys.executable, "-m", "benchmarks.ft_exchange", "--params",
                               str(params)], env=env, capture_output=True, text=True,
                              timeout=900, check=True)
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


NETWORK = "1,0.01"   # the emulated link between groups far apart: 1 Gbit/s, 10 ms
FAR_EVERY = 20


# DiLoCo's outer SGD (learning rate, Nesterov momentum): the paper's, and one for short runs
# at small H (fewer outer steps for momentum to build up: BENCHMARKS.md has the sweep)
FAR_OUTERS = ((0.7, 0.9), (0.6, 0.6))
FAR_FRAGMENTS, FAR_OVERLAP = 4, 2   # Streaming DiLoCo's F and tau


def far_modes(every: int = FAR_EVERY) -> tuple:
    """(name, the example's options) of each mode the far part runs, syncing every `every`
    steps, DiLoCo with each of `FAR_OUTERS`; Streaming DiLoCo (`FAR_FRAGMENTS`,
    `FAR_OVERLAP`) where H is a multiple of F and a fragment's turn (H / F steps) is longer
    than its overlap."""
    h = ["--sync_every", str(every)]
    modes = [("synchronous", []), (f"LocalSGD, H = {every}", h)]
    for lr, momentum in FAR_OUTERS:
        outer = ["--outer", "diloco", "--outer_lr", str(lr), "--outer_momentum", str(momentum)]
        named = f"outer {lr:g} / {momentum:g}"
        modes.append((f"DiLoCo, H = {every}, {named}", [*h, *outer]))
        if every % FAR_FRAGMENTS == 0 and every // FAR_FRAGMENTS > FAR_OVERLAP:
            modes.append((f"Streaming DiLoCo, H = {every}, F = {FAR_FRAGMENTS}, "
                          f"tau = {FAR_OVERLAP}, {named}",
                          [*h, *outer, "--fragments", str(FAR_FRAGMENTS), "--overlap",
                           str(FAR_OVERLAP)]))
    return (*modes, ("alone (one sync, at the end)", None))


FAR_MODES = far_modes()
FINAL = re.compile(r'\{"group": 0, .*\}')


def far_apart(root: str, steps: int, groups: int = GROUPS, devices: int = 2,
              pace: float = 0.0, modes: tuple = FAR_MODES) -> list:
    """The MNIST CNN on real digits (`--task mnist5k`, Adam 1e-3) under each of `modes` at
    the emulated `NETWORK`, `groups` groups of `devices` devices, each step paced to `pace`
    seconds (the example's `--step_time`: a step as long as a larger model's, the host idle
    meanwhile): per group-0 step, the seconds, the seconds blocked on the other groups and
    the bytes sent, and the test loss after `steps` steps."""
    out = []
    if steps <= 2 * FAR_EVERY:   # tiny: synchronous, the first streaming mode, alone
        streaming = [m for m in modes if "tau" in m[0]][:1]
        modes = tuple(m for m in modes if m[0] == "synchronous" or m in streaming
                      or m[1] is None)
    for i, (name, args) in enumerate(modes):
        args = ["--sync_every", str(steps)] if args is None else args
        where = os.path.join(root, str(i))
        job = ft_job(where,
                     ["examples/fault_tolerant.py", "--task", "mnist5k", "--steps", str(steps),
                      "--lr", "0.001", "--step_time", str(pace), *args], restarts=0,
                     env={"JDP_FT_NETWORK": NETWORK}, groups=groups, devices=devices)
        finish(job, 1800)
        commits = [e for e in read(job.events[0]) if e["event"] == "commit"]
        inner = [e.get("inner", e["step"]) for e in commits]
        log = open(os.path.join(where, "g0", "launcher.log")).read()
        out.append({"mode": name, "steps": inner[-1], "groups": groups, "devices": devices,
                    "pace": pace,
                    "step_s": (commits[-1]["time"] - commits[0]["time"]) / (inner[-1] - inner[0]),
                    "blocked_s": sum(e["blocked"] for e in commits[1:]) / inner[-1],
                    "bytes": commits[-1]["sent"] / inner[-1],
                    **json.loads(FINAL.findall(log)[-1])})
    return out


PARTS = ("heal", "step", "goodput", "churn", "exchange", "far")


def measure(size: dict, parts=PARTS) -> dict:
    """The figures of `parts` (of `PARTS`), each in its own temporary directory."""
    run = {"heal": lambda d: heal(d, size["heal_params"]),
           "step": lambda d: step_times(d, size), "goodput": lambda d: goodput(d, size),
           "churn": lambda d: churn(d, size),
           "exchange": lambda d: exchange(size["exchange_params"]),
           "far": lambda d: far_apart(d, size["far_steps"], size.get("far_groups", GROUPS),
                                      size.get("far_devices", 2), size.get("far_pace", 0.0),
                                      far_modes(size.get("far_every", FAR_EVERY)))}
    with tempfile.TemporaryDirectory(prefix="jdp-bench-ft-") as root:
        return {part: run[part](os.path.join(root, part)) for part in parts}


def _s(x, digits: int = 2) -> str:
    return "none" if x is None else f"{x:.{digits}f}"


def _stall_rows(g: dict) -> list:
    kills = g["ft"]["kills"]
    stalled = [k["stall_s"] for k in kills if k["stall_s"] is not None]
    healed = [k["heal_s"] for k in kills if k["heal_s"] is not None]
    return [["survivors' stall per kill (max)", f"{_s(max(stalled, default=None))} s (each: "
             + ", ".join(_s(k["stall_s"]) for k in kills) + ")", "<= 2 s",
             f"the {len(kills)} kills of the FT goodput run (below); "
             f"{sum(k.get('waited', False) for k in kills)} of them waited for the group's "
             "return"],
            ["heal of the returning group, example's state (max)",
             f"{_s(max(healed, default=None))} s", "", "the same kills; heal event's seconds"]]


def _churn_rows(churned: dict) -> list:
    kills, rows = churned["kills"], []
    for at, label in (("any", "while every group trains"), ("rejoin", "at another's return")):
        stalled = [k["stall_s"] for k in kills if k["at"] == at and k["stall_s"] is not None]
        rows.append([f"survivors' stall per kill {label} (max)",
                     f"{_s(max(stalled, default=None))} s (each: "
                     + ", ".join(_s(x) for x in stalled) + ")", "<= 2 s",
                     f"{len(stalled)} kills: churn rounds of two, the second the moment the "
                     "first group's new worker reaches the Lighthouse"])
    gaps = [r["gap_s"] for r in churned["returns"] if r["gap_s"] is not None]
    rows.append(["others' longest step at a group's return (max)",
                 f"{_s(max(gaps, default=None))} s (each: " + ", ".join(_s(x) for x in gaps)
                 + ")", "<= 2 s", f"{len(gaps)} returns of the churn rounds: the longest gap "
                 "between commits of a group not restarted, 10 s from the return's join"])
    return rows


def _heal_rows(h: dict) -> list:
    return [[f"heal of a {h['bytes'] // 4:,}-parameter state", f"{_s(h['heal_s'])} s", "<= 3 s",
             f"{h['bytes'] / 1e6:,.0f} MB moved (float32 params; SGD keeps no state); placing "
             f"on the devices {_s(h['place_s'])} s; survivors' stall {_s(h['stall_s'])} s"]]


def _step_rows(step: list) -> list:
    rows = []
    for width in dict.fromkeys(s["width"] for s in step):
        runs = [s for s in step if s["width"] == width]
        ft = statistics.median(s["ft"] for s in runs)
        plain = statistics.median(s["plain"] for s in runs)
        ratio = statistics.median(s["ft"] / s["plain"] for s in runs)
        rows.append([f"step time FT / plain, width {width} ({18 * width + 1:,} params)",
                     f"{ratio:.2f}x", "<= 1.10x", f"FT {ft * 1e3:.1f} ms, plain {plain * 1e3:.1f}"
                     f" ms per step; median of {len(runs)} interleaved pair(s)"])
    return rows


def _goodput_rows(g: dict, size: dict) -> list:
    rows = []
    for name, label in (("ft", "FT, kills of a group's worker"),
                        ("plain", f"plain + checkpoint every {CHECKPOINT_EVERY} steps, "
                                  "kills of a rank, --max_restarts")):
        x = g[name]
        rows.append([f"goodput, {label}", f"{x['goodput'] * 100:.1f} % of steps, "
                     f"{x['batches'] * 100:.1f} % of examples", "",
                     f"{x['killed']:,} steps vs {x['clean']:,} without kills "
                     f"({x['clean'] / size['duration']:.1f} steps/s) in {size['duration']} s, "
                     f"a kill every {size['every']} s"])
    return rows


def _exchange_rows(runs: list) -> list:
    rows = []
    for x, layout in ((x, layout) for x in runs for layout in ("replicated", "FSDP")):
        r = x[layout]
        rows.append([f"exchange's host time per step, {layout}, {x['devices']} devices, "
                     "buffers / pieces",
                     f"{r['buffers'] / r['pieces']:.2f}x", "< 1x",
                     f"{r['params']:,} float32 gradients over {x['devices']} CPU devices of one "
                     f"process, the all-reduce left out: buffers {r['buffers'] * 1e3:.1f} ms "
                     f"(jdp.ft), pieces {r['pieces'] * 1e3:.1f} ms (0.7's route); medians, "
                     "alternated"])
    return rows


def _far_rows(runs: list) -> list:
    sync, alone = runs[0], runs[-1]
    return [[r["mode"], f"{r['bytes'] / 1e3:,.1f}", f"{r['bytes'] / sync['bytes']:.3f}",
             f"{r['blocked_s'] * 1e3:.1f}", f"{r['blocked_s'] / r['step_s'] * 100:.1f} %",
             f"{alone['step_s'] / r['step_s']:.2f}x", f"{r['test_loss']:.4f}",
             f"{r['test_loss'] / sync['test_loss']:.2f}", f"{r['test_accuracy'] * 100:.1f} %"]
            for r in runs]


def render_far(runs: list) -> str:
    """The "groups far apart" table: one row per mode."""
    first = runs[0]
    paced = f", each step paced to {first['pace']:g} s" if first.get("pace") else ""
    return (f"Groups far apart: {first.get('groups', GROUPS)} groups x 1 process x "
            f"{first.get('devices', 2)} CPU devices{paced}, `examples/fault_tolerant.py "
            f"--task mnist5k` (the MNIST CNN with BatchNorm on 4,000 real digits, 16 per "
            f"process, Adam 1e-3), {runs[0]['steps']} steps, `JDP_FT_NETWORK={NETWORK}` (1 "
            f"Gbit/s, 10 ms between groups, each quorum too); figures per step of group 0. "
            f"\"alone\": the same "
            f"groups syncing once, at the end: the speed of groups that never wait (its loss "
            f"is that of three models averaged once).\n\n"
            + report.table(["mode", "KB sent per step", "/ synchronous",
                            "ms blocked per step", "of a step", "steps/s vs alone",
                            "test loss", "/ synchronous", "test accuracy"], _far_rows(runs)))


def render(r: dict, size: dict) -> str:
    """The markdown: one table of the issue's four figures, then one row per kill."""
    rows = [*(_stall_rows(r["goodput"]) if "goodput" in r else []),
            *(_heal_rows(r["heal"]) if "heal" in r else []),
            *(_step_rows(r["step"]) if "step" in r else []),
            *(_goodput_rows(r["goodput"], size) if "goodput" in r else []),
            *(_churn_rows(r["churn"]) if "churn" in r else []),
            *(_exchange_rows(r["exchange"]) if "exchange" in r else [])]
    kills = r["goodput"]["ft"]["kills"] if "goodput" in r else []
    per_kill = report.table(
        ["kill", "group", "survivors' stall (s)", "went on without it", "its heal (s)",
         "healed at step"],
        [[i + 1, k["victim"], _s(k["stall_s"]), "no" if k.get("waited") else "yes",
          _s(k["heal_s"]), k["heal_step"]]
         for i, k in enumerate(kills)])
    far = "\n" + render_far(r["far"]) if "far" in r else ""
    return (f"3 replica groups x 1 process x 2 CPU devices, each under its own `jdp.launch` "
            f"(`examples/fault_tolerant.py`, 16 examples per process, Adam); plain: one "
            f"`jdp.launch --nproc_per_node 3 --devices_per_process 2` job of the same model "
            f"(`benchmarks.ft_plain`). Goodput: what a run with kills made in a "
            f"{size['duration']} s window after step {WARM}, over what one without kills made "
            f"(steps; examples: an FT step with 2 of 3 groups is 2/3 of a batch). "
            f"{os.cpu_count()} CPU cores shared by all the processes.\n\n"
            + report.table(["figure", "measured", "target", "how"], rows)
            + ("\nKills in the FT goodput run (SIGKILL of the group's worker process):\n\n"
               + per_kill if kills else "") + far)


def table(size: str = "quick") -> str:
    """The table at `size` ("tiny", "quick", "full"); a line saying why when torchft is absent."""
    if importlib.util.find_spec("torchft") is None:
        return ("Not measured: torchft is not installed (pip install 'jdp[ft]').\n\n"
                + report.table(["figure", "measured"], [["all", "skipped: no torchft"]]))
    return render(measure(SIZES[size]), SIZES[size])


def main(argv=None) -> None:
    """`python -m benchmarks.ft [--size S] [--parts P,...] [--duration D --every E]
    [--far_groups G --far_devices D --far_pace S --far_every H]`: the table, as markdown, on
    stdout."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.ft", description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="quick")
    p.add_argument("--parts", default=",".join(PARTS), help="which of " + ",".join(PARTS))
    p.add_argument("--duration", type=int, help="the goodput runs' window (s)")
    p.add_argument("--every", type=int, help="seconds between kills in the goodput runs")
    p.add_argument("--far_groups", type=int, help="the far part's groups (default 3)")
    p.add_argument("--far_devices", type=int, help="the far part's devices per group (2)")
    p.add_argument("--far_pace", type=float,
                   help="the far part's seconds per step (the example's --step_time)")
    p.add_argument("--far_every", type=int, help=f"the far part's H (default {FAR_EVERY})")
    args = p.parse_args(argv)
    given = {"duration": args.duration, "every": args.every, "far_groups": args.far_groups,
             "far_devices": args.far_devices, "far_pace": args.far_pace,
             "far_every": args.far_every}
    size = {**SIZES[args.size], **{k: v for k, v in given.items() if v}}
    parts = [x for x in args.parts.split(",") if x]
    if not set(parts) <= set(PARTS):
        p.error(f"--parts {args.parts}: choose among {','.join(PARTS)}")
    print(render(measure(size, parts), size))


if __name__ == "__main__":
    main()
