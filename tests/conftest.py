"""Shared test set-up: 8 simulated CPU devices, free ports, child processes.

The device count must be fixed before jax is imported, so it is set here at import time.
"""
import os
import shutil
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


MPIRUN = shutil.which("mpirun")   # Open MPI's launcher; the mpirun tests skip without it


def mpirun_command(script, forward, *args) -> list:
    """`mpirun -np 2 python script args...` as root on this one machine (oversubscribed),
    forwarding the environment variables named in `forward` to both ranks."""
    return [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", "2",
            *(arg for name in forward for arg in ("-x", name)), sys.executable, str(script),
            *args]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the launcher's own pick),
    with the next port free too: a launcher of several nodes takes it as its --rdzv_port."""
    from jdp.job.net import free_port as pick  # imported late: jax must see XLA_FLAGS first
    from jdp.job.net import port_problem

    for _ in range(100):
        port = pick("127.0.0.1")
        if port < 65535 and port_problem("127.0.0.1", port + 1, settle_s=0) is None:
            return port
    return port


def child_env(devices: int = 1, **extra: str) -> dict:
    """Environment for a child process with `devices` simulated CPU devices.

    Launcher/rank variables of the test process itself are removed so that a child starts
    as a fresh single process unless `extra` says otherwise.
    """
    from jdp.job.env import RANK_VARS  # imported late: jax must see XLA_FLAGS first

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


def launch_fails(tmp_path, capsys, argv) -> str:
    """`python -m jdp.launch argv... ok.py` exits 2 before starting anything; its last line."""
    import jdp.launch  # imported late: jax must see XLA_FLAGS first
    script = write_script(tmp_path, "ok.py", "print('never runs')\n")
    with pytest.raises(SystemExit) as exit_info:
        jdp.launch.main([*argv, script])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "never runs" not in err, err
    return err.splitlines()[-1]


def run_python(args, env=None, timeout=120, cwd=None) -> subprocess.CompletedProcess:
    """Run `python args...` to completion (with a timeout) and capture its output."""
    return subprocess.run([sys.executable, *args], env=env or child_env(), cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout)


SYSTEM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "system")


def pytest_itemcollected(item) -> None:
    """Mark every test under tests/system/ (those that start processes) `system`, so that
    `pytest -m "not system and not long"` is the unit tests alone (make test-fast)."""
    if str(item.path).startswith(SYSTEM + os.sep):
        item.add_marker(pytest.mark.system)


def pytest_collection_modifyitems(items) -> None:
    """Run the `long` tests first, then the other system tests, then the unit tests (each in
    the files' order). make test's pytest-xdist workers take one file at a time in this order
    (--dist loadfile, not reordered; a file's module fixtures then run once), so both start on
    the longest files and end on short ones: in the files' order the long examples came last
    and kept one worker busy while the other idled."""
    items.sort(key=lambda item: -(2 * (item.get_closest_marker("long") is not None)
                                  + (item.get_closest_marker("system") is not None)))


@pytest.fixture
def port() -> int:
    return free_port()


def finish(procs, timeout: float) -> list:
    """Wait for every process (`timeout` s each) and return what each wrote to stdout.

    Whatever still runs on the way out (a timeout, an error) is stopped and reaped, so a failing
    test leaves no process behind: SIGTERM first, which mpirun passes on to its ranks (SIGKILL
    would leave them running), then SIGKILL after 5 s.
    """
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        running = [p for p in procs if p.poll() is None]
        for p in running:
            p.terminate()
        for p in running:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def run_ranks(args, timeout: float, nprocs: int = 2, devices: int = 2, **extra: str):
    """Run `python args...` as ranks 0..nprocs-1 of one job without a launcher.

    Each rank gets `devices` simulated devices and MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK, as
    torchrun would set them, plus `extra`; stdout and stderr are merged. Returns the exit codes
    and the logs (see finish for the timeout and the clean-up).
    """
    port = str(free_port())
    procs = [subprocess.Popen(
        [sys.executable, *map(str, args)], cwd=REPO,
        env=child_env(devices=devices, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                      WORLD_SIZE=str(nprocs), RANK=str(rank), **extra),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(nprocs)]
    logs = finish(procs, timeout)
    return [p.returncode for p in procs], logs


def assert_one_line(error, words) -> None:
    """A user mistake is reported in one line that names every word (the offending values)."""
    message = str(error)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)


def one_line_error(error, words, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` raises `error` with a one-line message naming every word.

    Returns the exception, for further checks.
    """
    with pytest.raises(error) as info:
        fn(*args, **kwargs)
    assert_one_line(info.value, words)
    return info.value


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


@pytest.fixture
def lighthouse(monkeypatch):
    """A torchft Lighthouse in this process for a replica-group test (`jdp.ft`): its address."""
    from jdp.ft import lighthouse as lh
    monkeypatch.setenv("RUST_LOG", "warn")   # read when torchft's logger starts: quorums unlogged
    server = lh.start(0)
    yield lh.address(server, "127.0.0.1")
    server.shutdown()


@pytest.fixture
def tagged(monkeypatch, tag):
    """For jobs started in this process (jdp.spawn): children inherit our environment, so tag
    it, clear launcher variables, and let them import the tests' modules (tests/system/
    launch/_spawn_targets.py)."""
    from jdp.job.env import RANK_VARS

    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "system", "launch")
    for name, value in job_env(tag).items():
        monkeypatch.setenv(name, value)
    for name in RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(tests)
    monkeypatch.setenv("PYTHONPATH", tests + os.pathsep + REPO)
    return tag


# A 2-rank job whose rank 1 leaves at step 5 while rank 0 runs collectives: with MODE=exit by
# sys.exit(3), else by raising RuntimeError. It prints "LEAVING <time.time()>" to stderr first,
# so a test can time how fast the whole job ends (jdp.launch, mpirun, srun).
RANK_1_LEAVES = """
import os, sys, time
import jax, numpy as np
import jdp

jdp.initialize()
assert jax.process_count() == 2, jax.process_count()
step_fn = jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")
x = np.ones(jax.local_device_count(), np.float32)
for step in range(10**6):                      # rank 0 keeps running collectives
    if jax.process_index() == 1 and step == 5:
        print(f"LEAVING {time.time()!r}", file=sys.stderr, flush=True)
        if os.environ["MODE"] == "exit":
            sys.exit(3)
        raise RuntimeError("boom from rank 1")
    step_fn(x).block_until_ready()
"""

# The rank-side scripts beside the tests (tests/system/**/_*.py) are run by the tests, not
# collected (the torch peer's imports torch, an optional extra); fnmatch's `*` spans folders.
collect_ignore_glob = ["_*.py", "*/_*.py"]
