"""Metrics files stay valid: a non-finite value (a NaN loss) is written to metrics.jsonl in a
form every JSON parser reads (the string "NaN", "Infinity" or "-Infinity"), and nothing is
printed on the way (tensorboardX used to print a line per non-finite scalar)."""
import json
import math

import pytest
from test_metrics import tensorboard_scalars

import jdp.metrics


def strict_rows(path) -> list:
    """The JSON lines, read the way jq and strict parsers read them: a bare NaN is an error."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    with open(path) as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


@pytest.mark.parametrize("value, text", [(float("nan"), "NaN"), (float("inf"), "Infinity"),
                                         (float("-inf"), "-Infinity")])
def test_a_non_finite_value_is_strict_json_that_float_reads_back(tmp_path, value, text):
    with jdp.metrics.Writer(tmp_path, primary=True, tensorboard=False, mlflow=False) as w:
        w.scalars(1, {"loss": value, "lr": 0.5})
    row = strict_rows(tmp_path / "metrics.jsonl")[0]
    assert row["loss"] == text and row["lr"] == 0.5 and row["step"] == 1
    got = float(row["loss"])
    assert math.isnan(got) if math.isnan(value) else got == value


def test_a_nan_loss_prints_nothing_and_still_reaches_tensorboard(tmp_path, capfd):
    pytest.importorskip("tensorboardX")
    with jdp.metrics.Writer(tmp_path, primary=True, mlflow=False) as w:
        w.scalars(1, {"loss": 0.5})
        w.scalars(2, {"loss": float("nan")})
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)
    board = tensorboard_scalars(tmp_path)["loss"]
    assert board[0] == (1, 0.5) and board[1][0] == 2 and math.isnan(board[1][1])
    assert [r["loss"] for r in strict_rows(tmp_path / "metrics.jsonl")] == [0.5, "NaN"]
