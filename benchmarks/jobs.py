"""The benchmark jobs: command lines and environments, one function per kind of job.

    jax_job     one process with k simulated CPU devices (XLA_FLAGS set before jax starts)
    launch_job  `python -m jdp.launch --nproc_per_node N --devices_per_process k`, gloo
    torch_job   `python -m torch.distributed.run --nproc_per_node N`, gloo, 1 thread per rank

Each runs a worker (`benchmarks.worker` or `benchmarks.torch_ddp`) that answers requests in its
own control directory (`benchmarks.protocol`).
"""
from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence
from typing import NamedTuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
                "MASTER_ADDR", "MASTER_PORT", "XLA_FLAGS", "OMP_NUM_THREADS")


class Job(NamedTuple):
    name: str
    control: str   # the job's directory of requests and answers (benchmarks.protocol)
    argv: list
    env: dict


def base_env(**extra: str) -> dict:
    """This process's environment without launcher variables or device flags, CPU only,
    with the repository importable."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def device_flags(devices: int) -> str:
    """XLA_FLAGS for `devices` simulated CPU devices (read when jax starts)."""
    return f"--xla_force_host_platform_device_count={devices}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _malloc_env(malloc: str) -> dict:
    """`JDP_MALLOC_TUNING=0` for the "default" jobs: it turns off jdp's own allocator tuning
    (`jdp.initialize()` and the launcher, jdp/_malloc.py), so they measure glibc's defaults."""
    return {"JDP_MALLOC_TUNING": "0"} if malloc == "default" else {}


def _worker_args(control: str, variants: Sequence[str], per_device: int, malloc: str) -> list:
    """Arguments of `python -m benchmarks.worker` for one job."""
    return ["-m", "benchmarks.worker", "--control", control, "--variants", ",".join(variants),
            "--per-device", str(per_device), "--malloc", malloc]


def jax_job(name: str, control: str, devices: int, variants: Sequence[str],
            per_device: int, malloc: str = "default") -> Job:
    """One process with `devices` simulated CPU devices."""
    return Job(name, control,
               [sys.executable, *_worker_args(control, variants, per_device, malloc)],
               base_env(XLA_FLAGS=device_flags(devices), **_malloc_env(malloc)))


def launch_job(name: str, control: str, nproc: int, devices_per_process: int,
               variants: Sequence[str], per_device: int, malloc: str = "default") -> Job:
    """`nproc` processes under jdp's launcher, `devices_per_process` devices each."""
    argv = [sys.executable, "-m", "jdp.launch", "--nproc_per_node", str(nproc),
            "--devices_per_process", str(devices_per_process), "--master_port", str(free_port()),
            *_worker_args(control, variants, per_device, malloc)]
    return Job(name, control, argv, base_env(**_malloc_env(malloc)))


def torch_job(name: str, control: str, nproc: int, per_rank: int, threads: int = 1,
              malloc: str = "default") -> Job:
    """`nproc` PyTorch DDP ranks under torchrun, `threads` threads each."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), "-m", "benchmarks.torch_ddp",
            "--control", control, "--per-rank", str(per_rank), "--threads", str(threads),
            "--malloc", malloc]
    return Job(name, control, argv, base_env(OMP_NUM_THREADS=str(threads), **_malloc_env(malloc)))


def torch_available() -> bool:
    """Whether PyTorch can be imported here (found, without importing it)."""
    import importlib.util
    return importlib.util.find_spec("torch") is not None
