"""The jobs of `benchmarks.ft`: 3 replica groups under their own launchers, or one plain
3-process job; their events files read back; kills of a group's worker or of a rank.

Each launcher runs in its own session with its output in `DIR/launcher.log` (and its ranks'
under `DIR/rank.K/`, `--logdir DIR`); `stop` ends a job by SIGTERM to its launchers.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from typing import NamedTuple

from benchmarks.harness import jobs
from jdp.job.events import read
from jdp.job.net import free_port

GROUPS = 3


class Job(NamedTuple):
    """A started job: its launchers, and the events file of each group (or the plain job's)."""
    launchers: list
    events: list


def _launcher(args: list, logdir: str, env: dict | None = None,
              devices: int = 2) -> subprocess.Popen:
    os.makedirs(logdir, exist_ok=True)
    with open(os.path.join(logdir, "launcher.log"), "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "jdp.launch", "--devices_per_process", str(devices),
             "--stop_grace", "3", "--logdir", logdir, *args],
            env=jobs.base_env("default", RUST_LOG="warn", **(env or {})),
            cwd=jobs.REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(ready, timeout: float, what: str):
    """`ready()`'s first true value, polled; TimeoutError naming `what` after `timeout` s."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = ready()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"benchmarks.ft: no {what} within {timeout:.0f} s")


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def ft_job(root: str, script: list, restarts: int, env: dict | None = None,
           groups: int = GROUPS, devices: int = 2) -> Job:
    """`groups` replica groups (1 process x `devices` devices each) of `script` (argv after
    the launcher's options), group 0 first with the Lighthouse; `env` added to their
    environment."""
    port, launchers, events = free_port(), [], []
    for g in range(groups):
        logdir = os.path.join(root, f"g{g}")
        lighthouse = f"start:{port}" if g == 0 else f"127.0.0.1:{port}"
        launchers.append(_launcher(
            ["--nproc_per_node", "1", "--max_restarts", str(restarts), "--replica_group",
             str(g), "--replica_groups", str(groups), "--ft_lighthouse", lighthouse, *script],
            logdir, env, devices))
        events.append(os.path.join(logdir, "ft_events.jsonl"))
        if g == 0:
            wait_for(lambda: _listening(port), 120, "Lighthouse listening")
    return Job(launchers, events)


def plain_job(root: str, script_args: list, restarts: int) -> Job:
    """One jdp job of 3 processes x 2 devices running `benchmarks.ft_plain`."""
    events = os.path.join(root, "plain.jsonl")
    launcher = _launcher(["--nproc_per_node", str(GROUPS), "--max_restarts", str(restarts),
                          "-m", "benchmarks.ft_plain", "--events", events, *script_args],
                         os.path.join(root, "plain"))
    return Job([launcher], [events])


def stop(job: Job, timeout: float = 60) -> None:
    """SIGTERM every launcher (they stop their ranks), SIGKILL what is left after `timeout`."""
    for p in job.launchers:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in job.launchers:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def finish(job: Job, timeout: float) -> None:
    """Wait for every launcher to exit by itself (stopped after `timeout` s)."""
    deadline = time.time() + timeout
    try:
        for p in job.launchers:
            p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        stop(job)
        raise TimeoutError(f"benchmarks.ft: a job did not finish within {timeout:.0f} s") from None


def steps_of(job: Job) -> list:
    """(time, step) of every step recorded: the groups' commits, or the plain job's steps."""
    return sorted((e["time"], e["step"]) for path in job.events for e in read(path)
                  if e["event"] in ("commit", "step"))


def step_at(steps: list, when: float) -> int:
    """The newest step recorded at or before `when` (0 before any)."""
    return max((s for t, s in steps if t <= when), default=0)


def victim_pid(job: Job, victim: int) -> int | None:
    """The pid of group `victim`'s worker (FT) or of rank `victim` (plain) once it has made a
    step since its latest (re)start; None before."""
    path = job.events[victim] if len(job.events) > 1 else job.events[0]
    events = read(path)
    joins = [e for e in events if e["event"] == "join" and e.get("rank", victim) == victim]
    if not joins:
        return None
    if any(t > joins[-1]["time"] for t, _ in steps_of(Job([], [path]))):
        return joins[-1]["pid"]
    return None


def kill_schedule(job: Job, start: float, duration: float, every: float,
                  rng: random.Random) -> list:
    """SIGKILL victim k % 3 near `start + k * every` (at random within a quarter interval) for
    k = 1, 2, ... before `start + duration`: [{"victim", "time", "pid"}] of each kill."""
    kills = []
    for k in range(1, int(-(-duration // every))):
        victim, at = (k - 1) % GROUPS, start + k * every + rng.uniform(-every / 4, every / 4)
        time.sleep(max(0.0, at - time.time()))
        pid = wait_for(lambda v=victim: victim_pid(job, v), 300, f"step of victim {victim}")
        os.kill(pid, signal.SIGKILL)
        kills.append({"victim": victim, "time": time.time(), "pid": pid})
    return kills
