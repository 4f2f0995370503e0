"""Checkpoint misuse: each mistake is a one-line error of the right type naming the value."""
import numpy as np
import pytest
from conftest import assert_one_line

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


@pytest.mark.parametrize("bad", [0, -2, "3", 2.0, True])
def test_bad_max_to_keep(tmp_path, bad):
    with pytest.raises(ValueError) as info:
        Checkpointer(tmp_path, max_to_keep=bad)
    assert_one_line(info.value, [f"max_to_keep={bad!r}"])


@pytest.mark.parametrize("bad", [0, -1, "10"])
def test_bad_timeout(tmp_path, bad):
    with pytest.raises(ValueError) as info:
        Checkpointer(tmp_path, timeout_s=bad)
    assert_one_line(info.value, [f"timeout_s={bad!r}"])


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
