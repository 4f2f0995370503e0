"""No jdp launcher: a job started by SLURM's `srun -n 2` fails as fast as under jdp.launch.

A rank's `sys.exit(3)` mid-training must end the job within 10 s with srun returning 3
(without jdp, JAX waits for its 300 s shutdown timeout and every task dies by SIGABRT, 134).
Needs a running SLURM (slurmctld + slurmd, e.g. Debian's slurm-wlm on this machine); skipped
when `srun` is absent or no node answers.
"""
import functools
import shutil
import subprocess
import sys
import time

import pytest
from conftest import RANK_1_LEAVES, REPO, child_env, wait_until_gone, write_script

SRUN = shutil.which("srun")


@functools.cache
def slurm_ready() -> bool:
    """Is there a SLURM controller with an idle node? Asked once per test process: `sinfo`
    waits up to 10 s for a controller that is not there."""
    if SRUN is None or shutil.which("sinfo") is None:
        return False
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                                timeout=10).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(s.startswith(("idle", "mix")) for s in states)


pytestmark = pytest.mark.skipif(not slurm_ready(), reason="no running SLURM (srun, sinfo with "
                                "an idle node; Debian package slurm-wlm)")


@pytest.mark.parametrize("mode, code", [("exit", 3), ("raise", 1)])
def test_a_failing_rank_ends_an_srun_job_with_its_code(tmp_path, tag, mode, code):
    script = write_script(tmp_path, "job.py", RANK_1_LEAVES)
    env = child_env(JDP_TEST_TAG=tag, MODE=mode)
    done = subprocess.run([SRUN, "-n", "2", "--overcommit", sys.executable, script], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    ended = time.time()
    assert "LEAVING" in done.stderr, done.stdout + done.stderr
    left = float(done.stderr.split("LEAVING ", 1)[1].split()[0])
    print(f"{mode}: srun exited {ended - left:.1f} s after rank 1 left, code {done.returncode}")
    assert done.returncode == code, done.stderr[-3000:]
    assert ended - left < 10
    assert wait_until_gone(tag, timeout=5.0) < 5.0


def test_scancel_signal_term_stops_every_task_at_one_step(tmp_path, tag):
    """SLURM's preemption notice (`scancel --signal=TERM`): every task saves at one step."""
    from test_fault_mpirun import LOOP
    script = write_script(tmp_path, "loop.py", LOOP)
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen([SRUN, "-n", "2", "--overcommit", f"--job-name={tag}",
                                 sys.executable, script], env=child_env(JDP_TEST_TAG=tag),
                                cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while out.read_text().count("ready") < 2:
            assert time.monotonic() < deadline and proc.poll() is None, out.read_text()
            time.sleep(0.1)
        subprocess.run(["scancel", "--signal=TERM", f"--name={tag}"], check=True, timeout=30)
        assert proc.wait(timeout=60) == 0, out.read_text()
    saved = [line.split("step ")[1] for line in out.read_text().splitlines() if "SAVED" in line]
    assert len(saved) == 2 and saved[0] == saved[1], out.read_text()
    assert wait_until_gone(tag, timeout=5.0) < 5.0


def test_a_rank_stuck_in_python_under_srun_is_named_with_its_line(tmp_path, tag):
    from test_fault_mpirun import PROGRESS_TIMEOUT, STUCK, check_stuck_rank_report
    script = write_script(tmp_path, "stuck.py", STUCK)
    env = child_env(JDP_TEST_TAG=tag, JDP_PROGRESS_TIMEOUT=str(PROGRESS_TIMEOUT))
    done = subprocess.run([SRUN, "-n", "2", "--overcommit", sys.executable, script], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    check_stuck_rank_report(done, script, time.time())
    assert wait_until_gone(tag, timeout=5.0) < 5.0
