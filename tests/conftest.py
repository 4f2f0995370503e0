"""Shared test set-up: 8 simulated CPU devices, free ports, child processes.

The device count must be fixed before jax is imported, so it is set here at import time.
"""
import os
import subprocess
import sys
import textwrap

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_DEVICES = 8


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the launcher's own pick)."""
    from jdp._net import free_port as pick  # imported late: jax must see XLA_FLAGS first

    return pick("127.0.0.1")


def child_env(devices: int = 1, **extra: str) -> dict:
    """Environment for a child process with `devices` simulated CPU devices.

    Launcher/rank variables of the test process itself are removed so that a child starts
    as a fresh single process unless `extra` says otherwise.
    """
    from jdp._env import RANK_VARS  # imported late: jax must see XLA_FLAGS first

    env = {k: v for k, v in os.environ.items() if k not in (*RANK_VARS, "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def write_script(tmp_path, name: str, body: str) -> str:
    """Write a dedented Python script under tmp_path and return its path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def run_python(args, env=None, timeout=120, cwd=None) -> subprocess.CompletedProcess:
    """Run `python args...` to completion (with a timeout) and capture its output."""
    return subprocess.run([sys.executable, *args], env=env or child_env(), cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def port() -> int:
    return free_port()


# --- multi-process jobs (launcher, spawn): tag every process, find leftovers ---------------

TAG_ENV = "JDP_TEST_TAG"


def job_env(tag: str, devices: int = 1, **extra: str) -> dict:
    """child_env plus a tag that every process of the job inherits (see job_processes)."""
    return child_env(devices=devices, **{TAG_ENV: tag}, **extra)


def job_processes(tag: str) -> list:
    """Live processes (not zombies) whose environment carries JDP_TEST_TAG=tag."""
    import psutil
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(TAG_ENV) == tag:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def wait_until_gone(tag: str, timeout: float) -> float:
    """Seconds until no process of the job remains; fails the test after `timeout`."""
    import time
    start = time.monotonic()
    while job_processes(tag):
        if time.monotonic() - start > timeout:
            left = [(p.pid, p.cmdline()) for p in job_processes(tag)]
            for p in job_processes(tag):
                p.kill()
            pytest.fail(f"processes of the job still alive after {timeout} s: {left}")
        time.sleep(0.02)
    return time.monotonic() - start


def start_launcher(args, env: dict, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    """Start `python -m jdp.launch args...` (text pipes unless files are given)."""
    return subprocess.Popen([sys.executable, "-m", "jdp.launch", *map(str, args)], env=env,
                            cwd=REPO, stdout=stdout, stderr=stderr, text=True)


def wait_for_text(path, text: str, count: int, timeout: float) -> None:
    """Wait until file `path` contains `text` at least `count` times."""
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and open(path).read().count(text) >= count:
            return
        time.sleep(0.05)
    pytest.fail(f"{path} did not show {text!r} {count} times within {timeout} s")


@pytest.fixture
def tag() -> str:
    """A fresh job tag; at the end of the test no process carrying it may remain."""
    import uuid
    value = uuid.uuid4().hex
    yield value
    wait_until_gone(value, timeout=5.0)
