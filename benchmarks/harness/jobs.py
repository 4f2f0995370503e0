"""The benchmark jobs: one command line and environment per configuration.

"default" jobs run with glibc's malloc defaults (`JDP_MALLOC_TUNING=0`), "tuned" ones with
jdp's allocator settings (`jdp.job.malloc.ENV`, read by glibc at start, as the launcher
sets them).
"""
from __future__ import annotations

import os
import sys
from typing import NamedTuple

from jdp.job.env import RANK_VARS
from jdp.job.malloc import ENV as MALLOC_ENV
from jdp.job.net import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Job(NamedTuple):
    name: str
    control: str  # its directory of requests and answers (`benchmarks.harness.control`)
    argv: list
    env: dict


def base_env(malloc: str = "default", **extra: str) -> dict:
    """This environment, CPU only, without launcher variables or device flags, the repository
    and the examples' modules importable, and the allocator as asked."""
    env = {k: v for k, v in os.environ.items()
           if k not in (*RANK_VARS, "XLA_FLAGS", "OMP_NUM_THREADS", *MALLOC_ENV)}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "examples"),
                                           env.get("PYTHONPATH", "")]))
    env.update({"JDP_MALLOC_TUNING": "0"} if malloc == "default" else MALLOC_ENV)
    return {**env, **extra}


def device_flags(devices: int) -> str:
    """XLA_FLAGS for `devices` simulated CPU devices."""
    return f"--xla_force_host_platform_device_count={devices}"


def job(name: str, root: str, kind: str, malloc: str, variants=("jdp",), devices=2) -> Job:
    """`kind` "jax" (one process, `devices` devices), "launch" (`jdp.launch`, 2 processes x 1
    device) or "torch" (PyTorch DDP under torchrun, 2 ranks x 1 thread), all over gloo."""
    control, port = os.path.join(root, name), str(free_port())
    worker = ["-m", "benchmarks.worker", control, ",".join(variants)]
    argv, env = {
        "jax": (worker, {"XLA_FLAGS": device_flags(devices)}),
        "launch": (["-m", "jdp.launch", "--nproc_per_node", "2", "--devices_per_process", "1",
                    "--master_port", port, *worker], {}),
        "torch": (["-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                   "--master_addr", "127.0.0.1", "--master_port", port,
                   "-m", "benchmarks.torch_ddp", control], {"OMP_NUM_THREADS": "1"})}[kind]
    return Job(name, control, [sys.executable, *argv], base_env(malloc, **env))


def plan(root: str, malloc_scaling: bool, torch: bool) -> list[Job]:
    """Every job of a run, with glibc's malloc, then tuned (1, 4, 8 devices if `malloc_scaling`)."""
    out = []
    for tag, malloc in (("", "default"), ("+malloc", "tuned")):
        for k in (1, 2, 4, 8) if malloc_scaling or not tag else (2,):
            variants = ("jdp", "hand", "pmap", "maxpool") if k == 2 else ("jdp",)
            out.append(job(f"{k}dev{tag}", root, "jax", malloc, variants, devices=k))
        out.append(job(f"2proc{tag}", root, "launch", malloc, ("jdp", "pmap")))
        out += [job(f"torch{tag}", root, "torch", malloc)] if torch else []
    return out


def command_line(job: Job) -> str:
    """The job as a reader would type it: the variables that set it apart, then the command."""
    shown = ("XLA_FLAGS", "OMP_NUM_THREADS", "JDP_MALLOC_TUNING", *MALLOC_ENV)
    return " ".join([*(f"{k}={job.env[k]}" for k in shown if k in job.env), "python",
                     *job.argv[1:]])
