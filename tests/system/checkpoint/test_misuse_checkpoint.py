"""Checkpoint misuse: each mistake is a one-line error of the right type naming the value."""
import errno
import gc
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, assert_one_line, job_env, write_script

import jdp
from jdp.checkpoint import Checkpointer


def state(**extra):
    return jdp.replicate({"w": np.arange(6, dtype=np.float32).reshape(2, 3), **extra})


@pytest.fixture
def ckpt(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(5, state())
    return ckpt


def test_a_directory_that_is_a_file(tmp_path):
    path = tmp_path / "taken"
    path.write_text("not a directory")
    with pytest.raises(ValueError) as info:
        Checkpointer(path)
    assert_one_line(info.value, [repr(str(path)), "is a file"])


def test_a_directory_below_a_file_fails_at_save_naming_it(tmp_path):
    (tmp_path / "taken").write_text("")
    ckpt = Checkpointer(tmp_path / "taken" / "ckpt")
    assert ckpt.latest_step() is None  # nothing there to read: not an error
    with pytest.raises(ValueError) as info:
        ckpt.save(1, state())
    assert_one_line(info.value, [str(tmp_path / "taken" / "ckpt"), "cannot create"])


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-2, ValueError), ("3", TypeError),
                                        (2.0, TypeError), (True, TypeError)])
def test_bad_max_to_keep(tmp_path, bad, error):
    with pytest.raises(error) as info:
        Checkpointer(tmp_path, max_to_keep=bad)
    assert_one_line(info.value, [f"max_to_keep={bad!r}"])


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), ("10", TypeError),
                                        (float("inf"), ValueError)])
def test_bad_timeout(tmp_path, bad, error):
    with pytest.raises(error) as info:
        Checkpointer(tmp_path, timeout_s=bad)
    assert_one_line(info.value, [f"timeout_s={bad!r}"])


def test_numpy_integers_are_integers(tmp_path):
    ckpt = Checkpointer(tmp_path, max_to_keep=np.int64(1))
    ckpt.save(np.int32(1), state())
    ckpt.save(np.int64(2), state())
    assert ckpt.all_steps() == [2]   # max_to_keep=1 kept the newest alone


@pytest.mark.parametrize("bad", ["5", 1.5, None, True, np.float32(2)])
def test_a_step_that_is_not_an_integer(ckpt, bad):
    with pytest.raises(TypeError) as info:
        ckpt.save(bad, state())
    assert_one_line(info.value, [f"step={bad!r}"])


def test_a_negative_step(ckpt):
    with pytest.raises(ValueError) as info:
        ckpt.save(-1, state())
    assert_one_line(info.value, ["step=-1", ">= 0"])


@pytest.mark.parametrize("step", [5, 3])
def test_a_step_that_does_not_increase(ckpt, step):
    with pytest.raises(ValueError) as info:
        ckpt.save(step, state())
    assert_one_line(info.value, [f"step {step} is not after the latest checkpoint 5"])


def test_a_numpy_or_jax_integer_step_is_fine(ckpt):
    ckpt.save(np.int64(6), state())
    ckpt.save(jdp.replicate({"s": np.int32(7)})["s"][0], state())
    assert ckpt.all_steps() == [5, 6, 7]


def test_restore_of_a_step_that_does_not_exist(ckpt):
    with pytest.raises(ValueError) as info:
        ckpt.restore(state(), step=4)
    assert_one_line(info.value, ["no checkpoint for step 4", "saved steps: [5]"])


@pytest.mark.parametrize("bad", ["5", 5.0])
def test_restore_of_a_step_that_is_not_an_integer(ckpt, bad):
    with pytest.raises(TypeError) as info:
        ckpt.restore(state(), step=bad)
    assert_one_line(info.value, [f"step={bad!r}"])


def test_restore_into_a_differently_shaped_state(ckpt):
    with pytest.raises(ValueError) as info:
        ckpt.restore(jdp.replicate({"w": np.zeros((3, 2), np.float32)}))
    assert_one_line(info.value, ["w: checkpoint has shape (2, 3), state has (3, 2)"])


def test_restore_into_a_different_dtype(ckpt):
    with pytest.raises(ValueError) as info:
        ckpt.restore(jdp.replicate({"w": np.zeros((2, 3), np.int32)}))
    assert_one_line(info.value,
                    ["w: checkpoint has dtype float32, state has int32", "then cast"])


def test_restore_into_a_state_with_an_extra_or_a_missing_leaf(ckpt):
    with pytest.raises(ValueError) as info:
        ckpt.restore(state(b=np.zeros(2, np.float32)))
    assert_one_line(info.value, ["missing in checkpoint: b"])
    with pytest.raises(ValueError) as info:
        ckpt.restore(jdp.replicate({"v": np.zeros((2, 3), np.float32)}))
    assert_one_line(info.value, ["missing in checkpoint: v"])


def test_restore_with_a_loader_of_a_checkpoint_saved_without_one(ckpt):
    loader = jdp.data.Loader({"x": np.arange(16, dtype=np.float32)}, batch_size=8)
    with pytest.raises(ValueError) as info:
        ckpt.restore(state(), loader=loader)
    assert_one_line(info.value, ["checkpoint 5", "holds no loader position", "loader=None"])


@pytest.mark.parametrize("method", ["save", "restore"])
def test_a_state_with_no_arrays(ckpt, method):
    args = (6, {"lr": None}) if method == "save" else ({"lr": None},)
    with pytest.raises(ValueError) as info:
        getattr(ckpt, method)(*args)
    assert_one_line(info.value, ["the state dict has no array leaves"])


def test_a_loader_that_is_not_a_loader(ckpt):
    with pytest.raises(TypeError) as info:
        ckpt.save(6, state(), loader=[1, 2, 3])
    assert_one_line(info.value, ["loader=list has no state_dict()"])
    with pytest.raises(TypeError) as info:
        ckpt.restore(state(), loader=[1, 2, 3])
    assert_one_line(info.value, ["loader=list has no load_state_dict()"])


def test_a_loader_position_that_is_not_json(ckpt):
    class Odd:
        def state_dict(self):
            return {"rng": object}

    with pytest.raises(TypeError) as info:
        ckpt.save(6, state(), loader=Odd())
    assert_one_line(info.value, ["Odd.state_dict()", "JSON"])


def test_two_leaves_with_the_same_checkpoint_name(ckpt):
    with pytest.raises(ValueError) as info:
        ckpt.save(6, jdp.replicate({"a/b": np.ones(2), "a": {"b": np.ones(2)}}))
    assert_one_line(info.value, ["both named 'a/b'"])


def test_restore_from_an_empty_or_missing_directory_returns_the_state(tmp_path):
    given = state()
    assert Checkpointer(tmp_path / "missing").restore(given) is given
    assert not (tmp_path / "missing").exists()  # a reader creates nothing


def test_a_stacked_state_with_a_leaf_that_is_not_stacked(ckpt):
    mixed = {**state(), "x": np.ones(3, np.float32)}
    with pytest.raises(ValueError) as info:
        ckpt.save(6, mixed)
    assert_one_line(info.value, ["leaf ['x'] has shape (3,)", "jdp.pmap.replicate"])


def test_async_save_that_is_not_a_bool(tmp_path):
    with pytest.raises(TypeError) as info:
        Checkpointer(tmp_path, async_save="yes")
    assert_one_line(info.value, ["async_save='yes'"])


# --- issue 26: leaves that are not arrays, slots that must not vanish, a full disk ----------

NUMBERS = {"epoch": 3, "lr": 0.5, "flag": True, "big": 2**40 + 3, "tenth": np.float64(0.1),
           "half": np.float32(1.5), "count": np.int64(-7), "z": 1 + 2j}


def test_number_leaves_are_saved_and_come_back_with_their_type(ckpt):
    w = jdp.broadcast({"w": np.arange(6, dtype=np.float32).reshape(2, 3)})["w"]
    ckpt.save(6, {"w": w, **NUMBERS})
    got = ckpt.restore({"w": w, **{k: type(v)(0) for k, v in NUMBERS.items()}})
    for key, want in NUMBERS.items():
        assert type(got[key]) is type(want) and got[key] == want, (key, got[key])
    assert np.asarray(got["w"]).tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("leaf, words", [
    ("relu", ["leaf ['act'] is a str ('relu')", "arrays and numbers only"]),
    (b"raw", ["leaf ['act'] is a bytes"]),
    (print, ["leaf ['act'] is a builtin_function_or_method"]),
    (2**80, ["leaf ['act'] is a int"]),
])
def test_a_leaf_that_is_neither_array_nor_number_is_refused_not_dropped(ckpt, leaf, words):
    w = jdp.broadcast({"w": np.zeros((2, 3), np.float32)})["w"]
    with pytest.raises(TypeError) as info:
        ckpt.save(6, {"w": w, "act": leaf})
    assert_one_line(info.value, ["Checkpointer.save:", *words])
    with pytest.raises(TypeError):
        ckpt.restore({"w": w, "act": leaf})
    assert ckpt.all_steps() == [5]


def _uncommitted(tmp_path, directory, name):
    """A copy of step 2 without orbax's commit marker, as a killed save leaves it."""
    shutil.copytree(directory / "2", directory / name)
    os.remove(directory / name / "commit_success.txt")


@pytest.mark.parametrize("stray", ["empty", "uncommitted"])
def test_a_stray_step_directory_costs_no_intact_checkpoint(tmp_path, stray):
    directory = tmp_path / "ckpt"
    ckpt = Checkpointer(directory, max_to_keep=2)
    for step in (1, 2):
        ckpt.save(step, state())
    if stray == "empty":
        (directory / "50").mkdir()
    else:
        _uncommitted(tmp_path, directory, "50")
    assert ckpt.all_steps() == [1, 2]
    with pytest.warns(RuntimeWarning, match=r"removed step directories \['50'\]"):
        ckpt.save(3, state())
    assert ckpt.all_steps() == [2, 3]
    assert sorted(set(os.listdir(directory)) - {".jdp-writer"}) == ["2", "3"]


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("keep", [1, 2], ids=["one_byte_left", "half_left"])
def test_after_a_damaged_newest_checkpoint_the_resume_loop_saves_over_it(tmp_path, capfd, keep):
    def filled(value):
        return jdp.broadcast({"w": np.full((2, 3), value, np.float32)})

    directory = tmp_path / "ckpt"
    ckpt = Checkpointer(directory)
    ckpt.save(1, filled(1.0))
    ckpt.save(2, filled(2.0))
    for data in glob.glob(str(directory / "2" / "state" / "**" / "d" / "*"), recursive=True):
        os.truncate(data, 1 if keep == 1 else os.path.getsize(data) // 2)
    with pytest.warns(RuntimeWarning, match="checkpoint 2 .* is damaged"):
        resumed = ckpt.restore(filled(0.0))        # falls back to step 1
    assert np.asarray(resumed["w"]).tolist() == [[1.0] * 3] * 2
    ckpt.save(2, filled(9.0))                      # the resume loop's next save
    assert ckpt.all_steps() == [1, 2]
    assert np.asarray(Checkpointer(directory).restore(filled(0.0))["w"]).tolist() == \
        [[9.0] * 3] * 2
    ckpt.close()
    gc.collect()
    assert "Event loop is closed" not in capfd.readouterr().err


def test_saving_a_donated_state_says_so(ckpt):
    donated = state()
    donated["w"].delete()        # what a step with donation does to the state it was given
    with pytest.raises(RuntimeError) as info:
        ckpt.save(6, donated)
    assert_one_line(info.value, ["state leaf ['w'] was donated to an earlier step",
                                 "use the state the step returned"])


OTHER_JOB = """
import sys
import numpy as np
import jdp
ckpt = jdp.checkpoint.Checkpointer(sys.argv[1])
ckpt.save(1, jdp.broadcast({"w": np.zeros(3, np.float32)}))
print("saved", flush=True)
sys.stdin.read()           # until the test closes it
"""


def test_two_jobs_saving_into_one_directory_are_detected(tmp_path, tag):
    directory = tmp_path / "ckpt"
    script = write_script(tmp_path, "other.py", OTHER_JOB)
    other = subprocess.Popen([sys.executable, script, str(directory)], env=job_env(tag),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert other.stdout.readline().strip() == "saved"
        ckpt = Checkpointer(directory)
        with pytest.raises(RuntimeError) as info:
            ckpt.save(2, state())
        assert_one_line(info.value, [f"another job (pid {other.pid} on host "
                                     f"{socket.gethostname()}", f"is saving into {directory}",
                                     "give each job its own checkpoint directory"])
    finally:
        other.communicate("", timeout=30)
    ckpt.save(2, state())        # that job has ended: its directory is taken over
    assert ckpt.all_steps() == [1, 2]


def test_a_job_whose_directory_was_taken_over_stops_saving(ckpt, tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        marker = {"host": "elsewhere", "pid": sleeper.pid, "start": None, "time": time.time()}
        (tmp_path / "ckpt" / ".jdp-writer").write_text(json.dumps(marker))
        with pytest.raises(RuntimeError) as info:
            ckpt.save(6, state())
        assert_one_line(info.value, [f"another job (pid {sleeper.pid} on host elsewhere",
                                     "took over the checkpoint directory",
                                     "after this job's last save"])
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)


def test_a_full_disk_is_one_line_and_keeps_the_earlier_checkpoint(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        ckpt = Checkpointer(mount / "ckpt")
        small = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "big": np.zeros(1)}
        ckpt.save(1, jdp.broadcast(small))
        big = jdp.broadcast({"w": np.ones((2, 3), np.float32),
                             "big": np.random.default_rng(0).random(1 << 19)})  # 4 MiB
        with pytest.raises(OSError) as info:
            ckpt.save(2, big)
        assert_one_line(info.value, [f"no space left on {mount / 'ckpt'} while saving step 2"])
        assert info.value.errno == errno.ENOSPC
        assert ckpt.all_steps() == [1]
        got = ckpt.restore(jdp.broadcast({"w": np.zeros((2, 3), np.float32),
                                          "big": np.ones(1)}))
        assert np.asarray(got["w"]).tolist() == [[0, 1, 2], [3, 4, 5]]
        ckpt.close()
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
