"""The progress watchdog: a rank that stops making progress is named, shown and stopped.

A 2-rank job runs collectives and records its progress as jdp's own steps do; rank 1 then
sleeps forever before step 6. With --progress_timeout 10 the launcher must stop the job
within 25 s of the stall, name rank 1 with its step and phase, show the line of its sleep
as a traceback does (the frame, then its source line; no launcher frames), and leave no
process behind.
"""
import time

import _spawn_targets as targets
import pytest
from conftest import job_env, start_launcher, wait_until_gone, write_script

import jdp
from jdp.job import progress as _progress
from jdp.job import watchdog as _watchdog

STUCK = """
import sys, time
import jax, numpy as np
import jdp
from jdp.job import rank

jdp.initialize()
step_fn = jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")
x = np.ones(jax.local_device_count(), np.float32)
for step in range(1, 10**6):
    rank.record("data", step - 1)
    if jax.process_index() == 1 and step == 6:
        print(f"STALL {time.time()!r}", file=sys.stderr, flush=True)
        time.sleep(10**6)
    rank.record("step", step)      # as train_step: entering its step-th step
    step_fn(x).block_until_ready()
"""
SLEEP_LINE = STUCK.splitlines().index("        time.sleep(10**6)") + 1   # 1-based


def test_a_stuck_rank_is_named_shown_and_stopped(tmp_path, tag):
    script = write_script(tmp_path, "stuck.py", STUCK)
    proc = start_launcher(["--nproc_per_node", 2, "--progress_timeout", 10, script],
                          job_env(tag))
    out, err = proc.communicate(timeout=180)
    ended = time.time()
    stalled = float(err.split("STALL ", 1)[1].split()[0])
    print(f"launcher exited {ended - stalled:.1f} s after the stall")
    assert proc.returncode == 124, err
    assert ended - stalled < 25
    report = err[err.index("jdp.launch: no rank made progress"):]
    assert "rank 1 stuck at step 5 in phase data" in report, report
    assert "rank 0 waiting at step 6" in report, report
    assert f'File "{script}", line {SLEEP_LINE}, in <module>' in report, report
    assert "time.sleep(10**6)" in report, report                     # its source line
    assert "runpy" not in report and "run.py" not in report, report
    assert wait_until_gone(tag, timeout=2.0) < 2.0


def test_no_progress_before_the_first_record_is_not_a_stall(tmp_path, tag):
    """Start-up and compilation are not timed: a job that records nothing runs to its end."""
    script = write_script(tmp_path, "slow_start.py", "import time\ntime.sleep(4)\n")
    proc = start_launcher(["--nproc_per_node", 2, "--progress_timeout", 1, script],
                          job_env(tag))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


def test_a_start_up_that_never_records_is_named_after_the_start_up_limit(tmp_path, tag):
    """Ranks stuck before any record (their imports, a collective before any jdp call) are
    named with their stacks once JDP_STARTUP_TIMEOUT has passed, not left to hang."""
    script = write_script(tmp_path, "hung_start.py", "import time\ntime.sleep(300)\n")
    start = time.time()
    proc = start_launcher(["--nproc_per_node", 2, "--progress_timeout", 1, script],
                          job_env(tag, JDP_STARTUP_TIMEOUT="4"))
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 124, err
    assert 4 <= time.time() - start < 25, err
    assert "no rank made progress since it started" in err, err
    assert "JDP_STARTUP_TIMEOUT" in err and "before its first step in phase start" in err, err
    assert f'File "{script}", line 2, in <module>' in err, err
    assert wait_until_gone(tag, timeout=2.0) < 2.0


def test_spawn_raises_timeout_error_naming_the_stuck_rank(tagged):
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        jdp.spawn(targets.stuck_at_step, args=(1, 3), nprocs=2, progress_timeout=5)
    elapsed = time.monotonic() - start
    print(f"spawn raised after {elapsed:.1f} s")
    text = str(info.value)
    assert "rank 1 stuck at step 3 in phase data" in text, text
    assert "_spawn_targets.py" in text and "stuck_at_step" in text, text
    assert elapsed < 60


def test_record_writes_every_calls_step_and_phase_into_the_slot(tmp_path, monkeypatch):
    """What each call leaves in the slot (its cost per call is `make bench`'s progress table,
    not a timed assertion here)."""
    slot = tmp_path / "slot"
    slot.write_bytes(bytes(_progress.SLOT_SIZE))
    monkeypatch.setenv("JDP_PROGRESS_FILE", str(slot))
    progress = _progress.Progress()   # a rank's progress of its own, mapping the slot file
    progress.record("eval", 7)
    assert _progress.read_slot(str(slot))[1:] == (7, "eval")
    for step in range(8, 1_000):
        progress.record("step", step)
    assert _progress.read_slot(str(slot))[1:] == (999, "step")


def test_a_slot_nothing_was_recorded_in_has_run_no_step(tmp_path, monkeypatch):
    """The supervisor's fresh slot is all zeros, as is a rank's own map: step -1, not 0."""
    slot = tmp_path / "slot"
    slot.write_bytes(bytes(_progress.SLOT_SIZE))
    monkeypatch.setenv("JDP_PROGRESS_FILE", str(slot))
    progress = _progress.Progress()
    progress.open()
    assert progress.current() == (0, -1, "start")
    assert _progress.read_slot(str(slot)) == (0, -1, "start")
    in_memory = _progress.Progress()
    in_memory.memory_slot()
    assert in_memory.current() == (0, -1, "start")
    progress.record("step", 0)
    assert progress.current() == (1, 0, "step") == _progress.read_slot(str(slot))


def test_describe_names_the_ranks_behind_and_groups_the_others():
    P = _watchdog.RankProgress
    text = _watchdog.describe([P(0, 6, "step"), P(1, 5, "data"), P(2, 6, "step"),
                               P(3, 6, "step")])
    assert text == "rank 1 stuck at step 5 in phase data; ranks 0, 2, 3 waiting at step 6"
    assert _watchdog.describe([P(0, -1, "start")]) == (
        "rank 0 stuck before its first step in phase start")
