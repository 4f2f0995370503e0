"""A job that watches a checkpoint directory (evaluation, export) never breaks the job that
saves into it, and only ever restores complete checkpoints equal to what was saved."""
import json
import os
import statistics
import subprocess
import sys

from conftest import REPO, finish, job_env, wait_until_gone

CHILD = os.path.join(REPO, "tests", "system", "checkpoint", "_checkpoint_concurrency_child.py")
SECONDS = 8    # about 65 saves and 375 restores here: far past the 10 of each required


def test_a_reader_in_a_loop_never_fails_a_save_nor_restores_a_partial_checkpoint(tmp_path, tag):
    directory = tmp_path / "ckpt"
    procs = {mode: subprocess.Popen(
        [sys.executable, CHILD, mode, str(directory), str(tmp_path / f"{mode}.json"),
         str(SECONDS)], cwd=REPO, env=job_env(tag, devices=2),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for mode in ("trainer", "reader")}
    logs = dict(zip(procs, finish(list(procs.values()), timeout=SECONDS + 90), strict=True))
    wait_until_gone(tag, timeout=10)
    assert [p.returncode for p in procs.values()] == [0, 0], logs
    trainer = json.loads((tmp_path / "trainer.json").read_text())
    reader = json.loads((tmp_path / "reader.json").read_text())
    save_s, restore_s = (statistics.median(trainer["save_s"]),
                         statistics.median(reader["restore_s"]))
    print(f"\nsaves: {trainer['saved']} (median {save_s:.3f} s); reader: "
          f"{reader['latest_calls']} opens + latest_step, {reader['restores']} restores "
          f"(median {restore_s:.3f} s) of {len(set(reader['steps']))} steps; "
          f"{reader['raced']} restores outrun 20 times (they say retry)")
    assert trainer["failures"] == [] and trainer["saved"] >= 10, trainer["failures"][:1]
    assert reader["errors"] == [] and reader["wrong"] == [], (reader["errors"][:1],
                                                              reader["wrong"][:3])
    # A restore outrun by the writer 20 times over (a loaded reader) raises the error that says
    # retry: neither a failed save nor a partial checkpoint, so not this test's failure.
    assert reader["warnings"] == [] and reader["restores"] >= 10
    # The directory holds the last max_to_keep=3 complete steps and nothing else.
    last = trainer["last_step"]
    assert sorted(set(os.listdir(directory)) - {".jdp-writer"}) == sorted(
        str(s) for s in range(last - 2, last + 1))
