"""Checkpointer(async_save=True): save returns early, and every way out of the process still
finishes the write (or, killed, leaves the previous checkpoint as the latest)."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, job_env

import jdp
from jdp.checkpoint import Checkpointer

CHILD = os.path.join(REPO, "tests", "system", "checkpoint", "_checkpoint_async_child.py")
BIG = 4_000_000


def want(step):
    """What the child saves at `step` (independent of its code: the same formula)."""
    return {"w": np.full(BIG, step, np.float32), "v": np.arange(BIG, dtype=np.float32) + step}


def assert_restores(directory, step):
    template = jdp.broadcast({"w": np.zeros(BIG, np.float32), "v": np.zeros(BIG, np.float32)})
    restored = Checkpointer(directory).restore(template, step=step)
    for key, value in want(step).items():
        assert np.asarray(restored[key]).tobytes() == value.tobytes(), key


def run_child(tmp_path, tag, how, sig=None):
    directory, marker = tmp_path / "ckpt", tmp_path / "marker"
    child = subprocess.Popen([sys.executable, CHILD, how, str(directory), str(marker)],
                             env=job_env(tag, devices=2), cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if sig is not None and marker.exists():
            child.send_signal(sig)
        log = child.communicate(timeout=90)[0]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    assert marker.exists(), log
    return directory, child.returncode, log


@pytest.mark.parametrize("how,sig,code", [("return", None, 0), ("raise", None, 1),
                                          ("sigterm", signal.SIGTERM, 0)])
def test_every_exit_finishes_the_background_write(tmp_path, tag, how, sig, code):
    directory, returncode, log = run_child(tmp_path, tag, how, sig)
    assert returncode == code, log
    assert "Exception ignored" not in log, log
    # complete, nothing left over (beside the writer's marker)
    assert sorted(set(os.listdir(directory)) - {".jdp-writer"}) == ["1", "2"]
    assert_restores(directory, 2)


def test_a_kill_during_the_background_write_keeps_the_previous_checkpoint(tmp_path, tag):
    directory, returncode, log = run_child(tmp_path, tag, "sigterm", signal.SIGKILL)
    assert returncode == -signal.SIGKILL, log
    ckpt = Checkpointer(directory)
    latest = ckpt.latest_step()
    assert latest in (1, 2)  # 2 only if its write was already finished
    assert_restores(directory, latest)
    ckpt.save(3, jdp.broadcast(want(3)))  # the next writer removes what the kill left
    assert sorted(set(os.listdir(directory)) - {".jdp-writer"}) == sorted({"1", str(latest), "3"})


def test_save_returns_before_the_write_and_later_calls_see_it(tmp_path):
    ckpt = Checkpointer(tmp_path, max_to_keep=1, async_save=True)
    for step in (1, 2):
        state = jdp.broadcast(want(step))
        ckpt.save(step, state)
        del state
    assert ckpt.latest_step() == 2  # waits for the write
    restored = ckpt.restore(jdp.broadcast({"w": np.zeros(BIG, np.float32),
                                           "v": np.zeros(BIG, np.float32)}))
    assert np.asarray(restored["w"]).tobytes() == want(2)["w"].tobytes()
    ckpt.close()
    assert sorted(set(os.listdir(tmp_path)) - {".jdp-writer"}) == ["2"]
