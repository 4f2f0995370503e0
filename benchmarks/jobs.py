"""The benchmark jobs: command lines and environments, one function per kind of job.

Each runs a worker (`benchmarks.worker` or `benchmarks.torch_ddp`) serving requests in its own
control directory (`benchmarks.harness`). `malloc="default"` jobs run with
`JDP_MALLOC_TUNING=0` (glibc's defaults); "tuned" jobs get jdp's allocator settings
(`jdp._malloc.ENV`, which glibc reads at start; `jdp.initialize()` applies the same).
"""
from __future__ import annotations

import importlib.util
import os
import socket
import sys
from collections.abc import Sequence
from typing import NamedTuple

from jdp._env import RANK_VARS  # the launcher's variable names: cleared for every job
from jdp._malloc import ENV as MALLOC_ENV

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Job(NamedTuple):
    """One configuration: its name, control directory, command line and environment."""
    name: str
    control: str
    argv: list
    env: dict


def base_env(malloc: str = "default", **extra: str) -> dict:
    """This process's environment without launcher variables or device flags, CPU only, the
    repository importable, and the allocator as asked."""
    env = {k: v for k, v in os.environ.items()
           if k not in (*RANK_VARS, "XLA_FLAGS", "OMP_NUM_THREADS", *MALLOC_ENV)}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    env.update({"JDP_MALLOC_TUNING": "0"} if malloc == "default" else MALLOC_ENV)
    return {**env, **extra}


def device_flags(devices: int) -> str:
    """XLA_FLAGS for `devices` simulated CPU devices (read when jax starts)."""
    return f"--xla_force_host_platform_device_count={devices}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jax_job(name: str, control: str, devices: int, variants: Sequence[str],
            malloc: str) -> Job:
    """One process with `devices` simulated CPU devices."""
    argv = [sys.executable, "-m", "benchmarks.worker", control, ",".join(variants)]
    return Job(name, control, argv, base_env(malloc, XLA_FLAGS=device_flags(devices)))


def launch_job(name: str, control: str, nproc: int, variants: Sequence[str],
               malloc: str) -> Job:
    """`nproc` processes of 1 device each under jdp's launcher (gloo)."""
    argv = [sys.executable, "-m", "jdp.launch", "--nproc_per_node", str(nproc),
            "--devices_per_process", "1", "--master_port", str(free_port()),
            "-m", "benchmarks.worker", control, ",".join(variants)]
    return Job(name, control, argv, base_env(malloc))


def torch_job(name: str, control: str, nproc: int, malloc: str) -> Job:
    """`nproc` PyTorch DDP ranks of 1 thread each under torchrun (gloo)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
            str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            "-m", "benchmarks.torch_ddp", control]
    return Job(name, control, argv, base_env(malloc, OMP_NUM_THREADS="1"))


def torch_available() -> bool:
    """Whether PyTorch can be imported here (found, without importing it)."""
    return importlib.util.find_spec("torch") is not None
