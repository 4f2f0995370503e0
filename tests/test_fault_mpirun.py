"""No jdp launcher: a job started by Open MPI's `mpirun` fails as fast as under jdp.launch.

`jdp.initialize()` joins the job through JAX's cluster detection. A rank that calls
`sys.exit(3)` mid-training must end the whole job within 10 s with exit code 3 (without jdp,
JAX's exit handler waits up to the shutdown timeout and then aborts every rank with SIGABRT).
The test runs the real mpirun (Debian's openmpi-bin); it is skipped where that is absent.
"""
import shutil
import subprocess
import sys
import time

import pytest
from conftest import RANK_1_LEAVES, REPO, child_env, wait_until_gone, write_script
from test_fault_preemption import LOOP as PREEMPTION_LOOP

MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI, Debian package "
                                "openmpi-bin) is not installed")


def mpirun(script, tag, mode):
    env = child_env(JDP_TEST_TAG=tag, MODE=mode)
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", "2",
           "-x", "JAX_PLATFORMS", "-x", "PYTHONPATH", "-x", "JDP_TEST_TAG", "-x", "MODE",
           "-x", "XLA_FLAGS", sys.executable, script]
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
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "JAX_PLATFORMS",
           "-x", "PYTHONPATH", "-x", "JDP_TEST_TAG", "-x", "XLA_FLAGS", sys.executable, script]
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
