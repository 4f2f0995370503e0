"""The benchmark jobs: command lines and environments, one function per kind of job.

Each runs a worker (`benchmarks.worker` or `benchmarks.torch_ddp`) serving requests in its own
control directory (`benchmarks.harness`). `malloc="default"` jobs run with
`JDP_MALLOC_TUNING=0` (glibc's defaults); "tuned" jobs get jdp's allocator settings
(`jdp._malloc.ENV`, which glibc reads at start; `jdp.initialize()` applies the same).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import NamedTuple

from jdp._env import RANK_VARS  # the launcher's variable names: cleared for every job
from jdp._malloc import ENV as MALLOC_ENV
from jdp._net import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Job(NamedTuple):
    name: str
    control: str   # its directory of requests and answers
    argv: list
    env: dict


def base_env(malloc: str = "default", **extra: str) -> dict:
    """This environment without launcher variables or device flags, CPU only, the repository
    importable, and the allocator as asked."""
    env = {k: v for k, v in os.environ.items()
           if k not in (*RANK_VARS, "XLA_FLAGS", "OMP_NUM_THREADS", *MALLOC_ENV)}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    env.update({"JDP_MALLOC_TUNING": "0"} if malloc == "default" else MALLOC_ENV)
    return {**env, **extra}


def device_flags(devices: int) -> str:
    """XLA_FLAGS for `devices` simulated CPU devices (read when jax starts)."""
    return f"--xla_force_host_platform_device_count={devices}"


def jax_job(name: str, root: str, devices: int, variants: Sequence[str], malloc: str) -> Job:
    """One process with `devices` simulated CPU devices."""
    control = os.path.join(root, name)
    return Job(name, control, [sys.executable, "-m", "benchmarks.worker", control,
                               ",".join(variants)],
               base_env(malloc, XLA_FLAGS=device_flags(devices)))


def launch_job(name: str, root: str, variants: Sequence[str], malloc: str) -> Job:
    """Two processes of 1 device each under jdp's launcher (gloo)."""
    control = os.path.join(root, name)
    return Job(name, control, [sys.executable, "-m", "jdp.launch", "--nproc_per_node", "2",
                               "--devices_per_process", "1", "--master_port", str(free_port()),
                               "-m", "benchmarks.worker", control, ",".join(variants)],
               base_env(malloc))


def torch_job(name: str, root: str, malloc: str) -> Job:
    """Two PyTorch DDP ranks of 1 thread each under torchrun (gloo)."""
    control = os.path.join(root, name)
    return Job(name, control, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                               "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                               "--master_port", str(free_port()), "-m", "benchmarks.torch_ddp",
                               control], base_env(malloc, OMP_NUM_THREADS="1"))
