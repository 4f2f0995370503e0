"""jdp.metrics.Writer: JSON lines always, TensorBoard event files that TensorBoard reads back.

The TensorBoard checks read the event files with TensorBoard's own EventAccumulator (an
independent reader) and compare with the JSON lines; they skip without tensorboard and
tensorboardX (extras `examples`, `test`).
"""
import json
import math
import os

import pytest
from conftest import REPO, child_env, run_python

import jdp.metrics


def tensorboard_scalars(logdir) -> dict:
    """tag -> [(step, value)] from the event files in logdir, read by TensorBoard itself."""
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def json_lines(path) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_scalars_go_to_json_lines_and_tensorboard_alike(tmp_path):
    pytest.importorskip("tensorboardX")
    values = [(1, 0.5), (2, 0.25), (7, 1 / 3)]
    with jdp.metrics.Writer(tmp_path, primary=True) as w:
        for step, loss in values:
            w.scalars(step, {"loss": loss, "lr": 0.1 * step})
    rows = json_lines(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == values
    board = tensorboard_scalars(tmp_path)
    assert [s for s, _ in board["loss"]] == [1, 2, 7]
    for (_, got), (_, want) in zip(board["loss"], values, strict=True):
        assert got == pytest.approx(want, rel=1e-6)          # float32 in the event file
    assert [v for _, v in board["lr"]] == pytest.approx([0.1, 0.2, 0.7], rel=1e-6)


def test_a_writer_that_is_not_primary_writes_nothing(tmp_path):
    with jdp.metrics.Writer(tmp_path / "logs", primary=False) as w:
        w.scalars(1, {"loss": 1.0})
    assert not (tmp_path / "logs").exists()


def test_without_tensorboard_only_json_lines_are_written(tmp_path):
    with jdp.metrics.Writer(tmp_path, primary=True, tensorboard=False, mlflow=False) as w:
        w.scalars(3, {"loss": float("nan")})
    assert os.listdir(tmp_path) == ["metrics.jsonl"]
    assert math.isnan(float(json_lines(tmp_path / "metrics.jsonl")[0]["loss"]))  # "NaN"


@pytest.mark.parametrize("step, values, words", [
    (-1, {"loss": 1.0}, ["step=-1", "int >= 0"]),
    (True, {"loss": 1.0}, ["step=True"]),
    (1, [1.0], ["values=list", "mapping"]),
    (1, {"loss": "low"}, ["'loss'='low'", "not a number"]),
])
def test_bad_scalars_are_refused_with_a_one_line_message(tmp_path, step, values, words):
    with jdp.metrics.Writer(tmp_path, primary=True, tensorboard=False) as w:
        with pytest.raises((ValueError, TypeError)) as info:
            w.scalars(step, values)
    message = str(info.value)
    assert "\n" not in message and all(word in message for word in words), message


def test_mlflow_is_skipped_cleanly_when_not_set_up(tmp_path, monkeypatch):
    """Installed or not, mlflow is used only with a tracking URI or an active run."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with jdp.metrics.Writer(tmp_path, primary=True, tensorboard=False) as w:
        assert w._mlflow is None
        w.scalars(1, {"loss": 1.0})


@pytest.mark.long
def test_the_mnist_example_logs_its_losses_to_tensorboard(tmp_path):
    """examples/mnist.py --logdir: TensorBoard reads back the losses the JSON lines hold."""
    pytest.importorskip("tensorboardX")
    logdir = tmp_path / "tb"
    done = run_python([os.path.join(REPO, "examples", "mnist.py"), "--epochs", "2",
                       "--batch-size", "64", "--dataset", "digits", "--quiet",
                       "--logdir", str(logdir)],
                      env=child_env(devices=8), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in json_lines(logdir / "metrics.jsonl") if "train/loss" in r]
    assert len(rows) >= 5, rows
    board = tensorboard_scalars(logdir)
    assert [s for s, _ in board["train/loss"]] == [r["step"] for r in rows]
    assert [v for _, v in board["train/loss"]] == pytest.approx(
        [r["train/loss"] for r in rows], rel=1e-6)
    assert all(math.isfinite(v) and v > 0 for _, v in board["train/loss"])
    assert [v for _, v in board["epoch/test_accuracy"]] == pytest.approx(
        [r["epoch/test_accuracy"] for r in json_lines(logdir / "metrics.jsonl")
         if "epoch/test_accuracy" in r], rel=1e-6)
