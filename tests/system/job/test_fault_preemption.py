"""Preemption: SIGTERM to the launcher or to one rank stops every rank at one common step.

The loop below agrees on the stop flag the way jdp's train step does (the flag rides in the
step's own all-reduce, `Preemption.set_agreed` takes the result), so these tests hold without
the step itself. The end-to-end test runs examples/mnist.py under the launcher: SIGTERM
mid-epoch, every rank saves at the same step, the rerun resumes there, and its final
parameters equal an uninterrupted run's bitwise.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, job_env, start_launcher, wait_for_text, wait_until_gone, write_script

from jdp.job.progress import Preemption

LOOP = """
import sys, time
import jax, numpy as np
import jdp
from jdp.job import rank

jdp.initialize()
stop = rank.current().stop
psum = jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")
n = jax.local_device_count()
for step in range(1, 10**6):
    flag = np.full(n, float(stop.flag()), np.float32)
    stop.set_agreed(float(psum(flag)[0]) > 0)      # what train_step does, in its pmean
    if jdp.preempted():
        print(f"SAVED rank {jax.process_index()} step {step}", flush=True)
        break
    if step == 3:
        print("ready", flush=True)
    time.sleep(0.02)
"""


def saved_steps(text: str) -> dict:
    """rank -> the step it saved at, from lines 'SAVED rank R step S'."""
    found = {}
    for line in text.splitlines():
        if "SAVED rank" in line:
            words = line.split("SAVED rank ", 1)[1].split()
            found[int(words[0])] = int(words[2])
    return found


def run_and_signal(tmp_path, tag, target):
    """Start the 2-rank LOOP, SIGTERM `target` ("launcher" or a rank), return (code, output)."""
    script = write_script(tmp_path, "loop.py", LOOP)
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = start_launcher(["--nproc_per_node", 2, script], job_env(tag), stdout=f,
                              stderr=subprocess.STDOUT)
        wait_for_text(out, "ready", 2, timeout=120)
        if target == "launcher":
            proc.send_signal(signal.SIGTERM)
        else:
            os.kill(rank_pid(tag, target), signal.SIGTERM)
        code = proc.wait(timeout=60)
    return code, out.read_text()


def rank_pid(tag: str, rank: int) -> int:
    """The pid of rank `rank` of the tagged job (the runner process with RANK=rank)."""
    from conftest import job_processes
    for p in job_processes(tag):
        env = p.environ()
        if env.get("RANK") == str(rank) and "jdp/job/run.py" in " ".join(p.cmdline()):
            return p.pid
    raise AssertionError(f"rank {rank} not found")


def test_sigterm_to_the_launcher_stops_every_rank_at_one_step(tmp_path, tag):
    start = time.monotonic()
    code, text = run_and_signal(tmp_path, tag, "launcher")
    print(f"launcher exited {time.monotonic() - start:.1f} s after start, code {code}")
    steps = saved_steps(text)
    assert sorted(steps) == [0, 1] and len(set(steps.values())) == 1, text
    assert code == 128 + signal.SIGTERM, text
    assert ("received SIGTERM; passed it on; all 2 process(es) have stopped (rank 0 exit code "
            "0, rank 1 exit code 0)") in text, text
    wait_until_gone(tag, timeout=5.0)


def test_sigterm_to_one_rank_stops_the_whole_job_cleanly(tmp_path, tag):
    code, text = run_and_signal(tmp_path, tag, 1)
    steps = saved_steps(text)
    assert sorted(steps) == [0, 1] and len(set(steps.values())) == 1, text
    assert code == 0, text
    wait_until_gone(tag, timeout=5.0)


IGNORING = """
import time

import pytest
import jdp
jdp.preempted()          # catches SIGTERM, then never looks again
print("ready", flush=True)
time.sleep(600)
"""


def test_a_rank_that_does_not_stop_is_killed_after_the_stop_grace(tmp_path, tag):
    script = write_script(tmp_path, "ignore.py", IGNORING)
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = start_launcher(["--nproc_per_node", 2, "--stop_grace", 2, script], job_env(tag),
                              stdout=f, stderr=subprocess.STDOUT)
        wait_for_text(out, "ready", 2, timeout=60)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        elapsed = time.monotonic() - start
    assert code == 128 + signal.SIGTERM
    assert 2.0 <= elapsed < 8.0, elapsed
    assert "rank(s) 0, 1 still ran 2 s later and were killed" in out.read_text()
    wait_until_gone(tag, timeout=5.0)


def test_preempted_alone_is_this_process_flag_until_a_step_agrees():
    stop = Preemption()                               # a rank's stop state of its own
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert stop.preempted() is False
        os.kill(os.getpid(), signal.SIGTERM)          # caught: sets the flag, no exit
        time.sleep(0.05)
        assert stop.flag() and stop.preempted()
        stop.set_agreed(False)                        # a step agreed: not yet on every rank
        assert not stop.preempted()
        stop.set_agreed(True)
        assert stop.preempted()
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- end to end: examples/mnist.py ---------------------------------------------------------

# Three epochs of 11 steps: a SIGTERM 1 s after epoch 1's record lands in epoch 2 or 3, never
# after the run (a fast machine) and never before epoch 1 ends.
MNIST = [os.path.join(REPO, "examples", "mnist.py"), "--dataset", "digits", "--epochs", "3",
         "--quiet"]


def final_params(*ckpt_dirs) -> list:
    """For each directory, the leaves of its newest checkpoint's parameters, restored in one
    fresh process."""
    code = f"""
import json, sys, numpy as np, jax
sys.path.insert(0, {os.path.join(REPO, 'examples')!r})
import jdp, mnist
template = jdp.replicate(mnist.create_train_state(0, 0.05, 10))
for ckpt_dir in {[str(d) for d in ckpt_dirs]!r}:
    state = jdp.checkpoint.Checkpointer(ckpt_dir).restore(template)
    print(json.dumps([np.asarray(x).ravel().tolist() for x in
                      jax.tree.leaves(jdp.unreplicate(state).params)]))
"""
    from conftest import child_env
    done = subprocess.run([sys.executable, "-c", code], env=child_env(devices=2), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()[-len(ckpt_dirs):]]


@pytest.mark.long
def test_mnist_preempted_mid_epoch_resumes_bitwise(tmp_path, tag):
    launch = ["--nproc_per_node", 2, "--devices_per_process", 2]
    straight = start_launcher([*launch, *MNIST, "--checkpoint-dir", tmp_path / "straight"],
                              job_env(tag))
    out, err = straight.communicate(timeout=600)
    assert straight.returncode == 0, err[-3000:]
    ckpt = tmp_path / "preempted"
    log = tmp_path / "first.txt"
    with open(log, "w") as f:
        first = start_launcher([*launch, *MNIST, "--checkpoint-dir", ckpt], job_env(tag),
                               stdout=f, stderr=subprocess.STDOUT)
        wait_for_text(log, "samples_per_s", 1, timeout=300)   # epoch 1 done: mid-epoch 2 next
        time.sleep(1.0)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    # Both ranks caught the SIGTERM, saved and left with 0 (not killed by the signal).
    assert "(rank 0 exit code 0, rank 1 exit code 0)" in log.read_text(), log.read_text()[-3000:]
    resumed = start_launcher([*launch, *MNIST, "--checkpoint-dir", ckpt], job_env(tag))
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    preempted, straight = final_params(ckpt, tmp_path / "straight")
    assert preempted == straight
