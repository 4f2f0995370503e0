"""The fault-tolerance benchmark (`benchmarks.ft`, `make bench` table 17) at its smallest size:
real launchers, 3 replica groups, one kill. Every figure's row is there with a finite number,
the kill table has one row per kill, and the heal moved the bytes of the state's float32
parameters; no timing is asserted (the machines are shared). Without torchft the table is one
row saying so."""
import math
import re

import pytest
from conftest import run_python

NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def rows(markdown: str) -> list:
    """The body rows of every markdown table of a text, as lists of cells."""
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in markdown.splitlines()
            if line.startswith("|") and not set(line.replace("|", "").split()) <= {"---"}]


def first_number(cell: str) -> float:
    found = NUMBER.findall(cell)
    assert found, cell
    return float(found[0].replace(",", ""))


@pytest.fixture(scope="module")
def table():
    """The table as `python -m benchmarks.ft --size tiny` prints it (it starts the launchers)."""
    pytest.importorskip("torchft")
    done = run_python(["-m", "benchmarks.ft", "--size", "tiny"], timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.long
def test_every_figure_has_a_finite_number(table):
    from benchmarks import ft
    size = ft.SIZES["tiny"]
    by_figure = {row[0]: row for row in rows(table)}
    expected = ["survivors' stall per kill (max)",
                f"heal of a {size['heal_params']:,}-parameter state",
                *(f"step time FT / plain, width {w} ({18 * w + 1:,} params)"
                  for w in size["widths"]),
                "goodput, FT, kills of a group's worker",
                "survivors' stall per kill while every group trains (max)",
                "survivors' stall per kill at another's return (max)",
                "others' longest step at a group's return (max)",
                *(f"exchange's host time per step, {layout}, {d} devices, buffers / pieces"
                  for d in ft.EXCHANGE_DEVICES for layout in ("replicated", "FSDP"))]
    for figure in expected:
        assert figure in by_figure, (figure, list(by_figure))
        value = first_number(by_figure[figure][1])
        assert math.isfinite(value) and value >= 0, by_figure[figure]
    streaming = next(m for m in ft.far_modes() if "tau" in m[0])[0]
    for mode in ("synchronous", streaming, "alone (one sync, at the end)"):
        row = by_figure[mode]   # the groups-far-apart table: every cell a finite number
        assert all(math.isfinite(first_number(cell)) for cell in row[1:]), row
    plain = [f for f in by_figure if f.startswith("goodput, plain")]
    assert len(plain) == 1 and math.isfinite(first_number(by_figure[plain[0]][1]))


def test_one_kill_row_per_kill_and_the_heal_moves_the_parameters(table):
    from benchmarks import ft
    size = ft.SIZES["tiny"]
    kills = [row for row in rows(table) if row[0].isdigit()]
    assert len(kills) == -(-size["duration"] // size["every"]) - 1
    for _, group, stall, _, heal, _ in kills:
        assert int(group) in range(ft.GROUPS)
        assert math.isfinite(float(stall)) and math.isfinite(float(heal))
    heal_row = next(row for row in rows(table) if row[0].startswith("heal of a "))
    assert f"{size['heal_params'] * 4 / 1e6:,.0f} MB moved" in heal_row[3]


def test_without_torchft_the_table_is_one_row_saying_so(monkeypatch):
    import importlib.util

    from benchmarks import ft
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchft" else find(name, *a))
    text = ft.table("tiny")
    assert "torchft is not installed" in text
    assert rows(text)[1:] == [["all", "skipped: no torchft"]]
