"""`jdp.spawn(fn, args, nprocs)`: torch.multiprocessing.spawn for a jdp job.

The functions run in the children live in _spawn_targets.py beside this file, so the children
can import them. Each test runs with a tag in the environment, which the children inherit, so
leftovers are found even if they were orphaned.
"""
import json
import os
import signal
import subprocess
import sys
import time

import _spawn_targets as targets
import pytest
from conftest import REPO, TAG_ENV, job_env, write_script

import jdp


def test_two_processes_of_two_devices_agree_on_the_global_mean(tmp_path, tagged):
    jdp.spawn(targets.global_mean, args=(str(tmp_path),), nprocs=2, devices_per_process=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    values = [10.0 * p + d for p in range(2) for d in range(2)]
    for rank, res in enumerate(results):
        assert res["rank"] == res["process_index"] == rank
        assert res["process_count"] == 2 and res["device_count"] == 4
        assert res["mean"] == pytest.approx(sum(values) / len(values))


def test_a_raising_rank_makes_the_parent_raise_with_its_traceback(tmp_path, tagged):
    start = time.monotonic()
    with pytest.raises(jdp.ProcessRaisedException) as info:
        jdp.spawn(targets.fail_on_rank, args=(1, str(tmp_path)), nprocs=2)
    elapsed = time.monotonic() - start
    print(f"spawn raised {elapsed:.2f} s after the call")
    assert elapsed < 10
    assert info.value.rank == 1 and info.value.exit_code == 1
    assert "rank 1 of 2 failed" in str(info.value)
    assert "RuntimeError: boom" in str(info.value) and "fail_on_rank" in str(info.value)
    import psutil
    for r in (0, 1):   # the sibling that slept 60 s was stopped too
        pid = int((tmp_path / f"pid{r}").read_text())
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("kwargs, error, message", [
    ({"nprocs": 0}, ValueError, "nprocs=0 must be an int >= 1"),
    ({"nprocs": 2, "devices_per_process": 0}, ValueError, "devices_per_process=0"),
])
def test_bad_arguments_raise_before_any_process_starts(kwargs, error, message):
    with pytest.raises(error, match=message):
        jdp.spawn(targets.global_mean, args=("unused",), **kwargs)


def test_a_function_children_cannot_import_is_refused():
    with pytest.raises(TypeError, match="module-level fn"):
        jdp.spawn(lambda rank: None, nprocs=2)


PARENT = """
import sys
import jdp
import _spawn_targets as targets

if __name__ == "__main__":
    try:
        jdp.spawn(targets.slow_to_interrupt, args=(sys.argv[1],), nprocs=2)
    except KeyboardInterrupt as e:
        print("parent got KeyboardInterrupt:", e, flush=True)
        sys.exit(130)
"""


def test_sigint_in_the_parent_reaches_every_rank(tmp_path, tag):
    """Ctrl-C: the parent forwards SIGINT to its ranks, stops them, raises KeyboardInterrupt.

    Rank 1 takes 0.5 s to act on it: process 0 waits for it, or the coordination service
    would end under it (a SIGABRT with a C++ stack instead of its KeyboardInterrupt)."""
    script = write_script(tmp_path, "parent.py", PARENT)
    env = job_env(tag, PYTHONPATH=os.path.dirname(__file__) + os.pathsep + REPO)
    assert env[TAG_ENV] == tag
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        parent = subprocess.Popen([sys.executable, script, str(tmp_path)], env=env, cwd=REPO,
                                  stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"pid{r}").exists() for r in (0, 1)):   # both ranks run fn
            assert time.monotonic() < deadline
            time.sleep(0.05)
        parent.send_signal(signal.SIGINT)
        assert parent.wait(timeout=10) == 130
    text = out.read_text()
    for r in (0, 1):   # each rank got the SIGINT itself (a KeyboardInterrupt in its sleep)
        assert f"[rank{r}]: KeyboardInterrupt" in text, text
    assert "coordination service" not in text, text
    assert "parent got KeyboardInterrupt" in out.read_text()


def test_a_rank_killed_by_a_signal_raises_process_exited(tagged):
    with pytest.raises(jdp.ProcessExitedException) as info:
        jdp.spawn(targets.killed_on_rank, args=(0,), nprocs=2)
    assert info.value.rank == 0 and info.value.exit_code == -signal.SIGKILL
    assert "rank 0 of 2 failed with signal SIGKILL" in str(info.value)


def test_timeout_stops_every_rank_and_raises(tmp_path, tagged):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="timeout=1"):
        jdp.spawn(targets.fail_on_rank, args=(-1, str(tmp_path)), nprocs=2, timeout=1)
    assert time.monotonic() - start < 10
