"""Ray Train's JaxTrainer on a real local Ray cluster (2 CPU workers), a loop that calls only
`jdp.initialize()`: one 2-process job with the losses of the same job started by torchrun's
variables, and a worker killed mid-training ends `fit()` with an error naming it; a plain Ray
actor (no Ray Train) is refused by `jdp.initialize()` with one line.

Needs the `ray` extra (`pip install -e ".[ray]"`); skips without it. The driver runs in a
child process (_ray_driver.py, beside this file), so this process never starts Ray or JAX's
backend.
"""
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, job_env, run_ranks, wait_until_gone

pytest.importorskip("ray.train.v2.jax", reason="the ray extra is not installed")

TESTS = os.path.join(REPO, "tests", "system", "distributed")   # _engine_train, _ray_driver


def test_jax_trainer_workers_train_one_job_and_a_killed_worker_is_named(tmp_path, tag):
    reference_codes, reference = run_ranks([os.path.join(TESTS, "_engine_train.py")],
                                           timeout=120, devices=1)
    assert reference_codes == [0, 0], reference
    expected = {line.split(" ", 3)[3] for log in reference for line in log.splitlines()
                if line.startswith("LOSSES ")}
    assert len(expected) == 1, reference
    path = os.pathsep.join([TESTS, REPO, os.environ.get("PYTHONPATH", "")])
    env = job_env(tag, devices=1, RAY_DEDUP_LOGS="0", PYTHONPATH=path)
    try:
        done = subprocess.run([sys.executable, os.path.join(TESTS, "_ray_driver.py"),
                               str(tmp_path), "train", "kill", "actor"], cwd=REPO, env=env,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=300)
    finally:
        wait_until_gone(tag, timeout=60)   # ray.shutdown() stops the cluster it started
    out = done.stdout
    assert "FIT train OK" in out, out[-5000:]
    for rank in (0, 1):
        assert f"jdp: joined as process {rank} of 2 via Ray Train" in out, out[-5000:]
        got = re.findall(rf"LOSSES {rank} 2 (\[.*\])", out)
        assert got and set(got) == expected, (got, expected)
        assert f"NODE {rank} 2" in out, out[-5000:]      # Ray's 2 workers share this node
    failed = next(line for line in out.splitlines() if line.startswith("FIT kill"))
    assert failed.startswith("FIT kill FAILED"), failed
    assert "[Rank 1 Error Snippet]" in failed and "died" in failed, failed
    assert "jdp: process 0 lost process 1 of the job" in out, out[-5000:]
    actor = next(line for line in out.splitlines() if line.startswith("ACTOR "))
    assert actor.startswith("ACTOR ValueError: jdp.initialize(): this process is a Ray "
                            "actor"), actor
    assert "JaxTrainer" in actor and "WORLD_SIZE=1 to train alone" in actor, actor
