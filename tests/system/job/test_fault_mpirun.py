"""No jdp launcher: a job started by Open MPI's `mpirun` fails as fast as under jdp.launch.

`jdp.initialize()` joins the job through JAX's cluster detection. A rank that calls
`sys.exit(3)` mid-training must end the whole job within 10 s with exit code 3 (without jdp,
JAX's exit handler waits up to the shutdown timeout and then aborts every rank with SIGABRT).
The test runs the real mpirun (Debian's openmpi-bin); it is skipped where that is absent.
"""
import subprocess
import time

import pytest
from conftest import (
    MPIRUN,
    RANK_1_LEAVES,
    REPO,
    child_env,
    mpirun_command,
    wait_until_gone,
    write_script,
)
from test_fault_preemption import LOOP as PREEMPTION_LOOP

pytestmark = pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI, Debian package "
                                "openmpi-bin) is not installed")


def mpirun(script, tag, mode):
    env = child_env(JDP_TEST_TAG=tag, MODE=mode)
    cmd = mpirun_command(script, ("JAX_PLATFORMS", "PYTHONPATH", "JDP_TEST_TAG", "MODE",
                                  "XLA_FLAGS"))
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("mode, code", [("exit", 3), ("raise", 1)])
def test_a_failing_rank_ends_an_mpirun_job_with_its_code(tmp_path, tag, mode, code):
    script = write_script(tmp_path, "job.py", RANK_1_LEAVES)
    done = mpirun(script, tag, mode)
    ended = time.time()
    assert "LEAVING" in done.stderr, done.stdout + done.stderr
    left = float(done.stderr.split("LEAVING ", 1)[1].split()[0])
    print(f"{mode}: mpirun exited {ended - left:.1f} s after rank 1 left, code "
          f"{done.returncode}")
    assert done.returncode == code, done.stdout + done.stderr[-3000:]
    assert ended - left < 10
    assert wait_until_gone(tag, timeout=5.0) < 5.0


LOOP = PREEMPTION_LOOP  # the same agreed-stop loop, started by mpirun instead of jdp.launch


def test_sigterm_to_mpirun_stops_every_rank_at_one_step(tmp_path, tag):
    """mpirun passes SIGTERM on to its ranks; they agree on the step as under jdp.launch."""
    script = write_script(tmp_path, "loop.py", LOOP)
    out = tmp_path / "out.txt"
    env = child_env(JDP_TEST_TAG=tag)
    cmd = mpirun_command(script, ("JAX_PLATFORMS", "PYTHONPATH", "JDP_TEST_TAG", "XLA_FLAGS"))
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while out.read_text().count("ready") < 2:
            assert time.monotonic() < deadline and proc.poll() is None, out.read_text()
            time.sleep(0.1)
        proc.terminate()
        proc.wait(timeout=60)
    saved = [line.split("step ")[1] for line in out.read_text().splitlines() if "SAVED" in line]
    assert len(saved) == 2 and saved[0] == saved[1], out.read_text()
    assert wait_until_gone(tag, timeout=5.0) < 5.0


# Rank 1 sleeps in Python before step 5 while rank 0 waits in the step's all-reduce.
STUCK = """
import sys, time
import jax, jax.numpy as jnp, numpy as np, optax
import jdp

jdp.initialize()
state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params={"w": jnp.zeros((4, 4))},
                                            tx=optax.sgd(0.01)))
step = jdp.train_step(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2))
batch = jdp.shard({"x": np.ones((2 * jax.local_device_count(), 4), np.float32)})
for i in range(1, 10**6):
    if jax.process_index() == 1 and i == 5:
        print(f"STALL {time.time()!r}", file=sys.stderr, flush=True)
        time.sleep(10**6)
    state, _ = step(state, batch)
"""
STUCK_LINE = STUCK.splitlines().index("        time.sleep(10**6)") + 1   # 1-based
PROGRESS_TIMEOUT = 10


def check_stuck_rank_report(done, script: str, ended: float) -> None:
    """The job ended non-zero within the timeout + 15 s, naming rank 1 with its source line."""
    err = done.stdout + done.stderr
    stalled = float(err.split("STALL ", 1)[1].split()[0])
    print(f"the job exited {ended - stalled:.1f} s after rank 1 stalled, code {done.returncode}")
    assert done.returncode != 0, err[-3000:]
    assert ended - stalled < PROGRESS_TIMEOUT + 15
    report = err[err.index("jdp: no rank made progress"):]
    assert "(JDP_PROGRESS_TIMEOUT): rank 1 stuck at step 4 in phase step" in report, report
    assert f'File "{script}", line {STUCK_LINE}, in <module>' in report, report
    assert "time.sleep(10**6)" in report, report                 # the frame's source line
    assert "runpy" not in report, report


def test_a_rank_stuck_in_python_under_mpirun_is_named_with_its_line(tmp_path, tag):
    script = write_script(tmp_path, "stuck.py", STUCK)
    env = child_env(JDP_TEST_TAG=tag, JDP_PROGRESS_TIMEOUT=str(PROGRESS_TIMEOUT))
    cmd = mpirun_command(script, ("JAX_PLATFORMS", "PYTHONPATH", "JDP_TEST_TAG", "XLA_FLAGS",
                                  "JDP_PROGRESS_TIMEOUT"))
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    check_stuck_rank_report(done, script, time.time())
    assert done.returncode == 124, done.stderr[-3000:]
    assert wait_until_gone(tag, timeout=5.0) < 5.0
