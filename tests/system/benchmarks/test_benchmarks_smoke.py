"""The benchmark suite at a tiny size: every table renders, well-formed, from sane numbers.

The suite's own measuring code (`run.measure`: calibration, interleaved rounds, paired ratios,
loader, HLO and profile requests) runs against an in-process worker on the 8 test devices with
2 examples per device, standing in for the 2-device jobs; the ZeRO table runs its own child
process on 2 devices with a tiny MLP. No timing is asserted (the machines
are shared); only that figures are finite and positive, that the compiled step all-reduces
exactly the bytes the trees predict, and that the tables are well-formed markdown. The full
suite is `make bench`.
"""
import math
import re
import sys
import textwrap
import types

import pytest
from conftest import REPO, child_env

NUMBER = re.compile(r"-?\d[\d,]*\.?\d*(?:e[-+]?\d+)?")


class InProcess:
    """A `harness.Worker` stand-in: requests go straight to a `worker.Bench`."""

    def __init__(self, bench):
        self.bench, self.info = bench, {"variants": list(bench.variants)}

    def request(self, op, **request):
        return getattr(self.bench, op)(request)


@pytest.fixture(scope="module")
def results():
    from benchmarks import worker
    from benchmarks.harness import run
    bench = InProcess(worker.Bench(["jdp", "hand", "pmap", "maxpool"], per_device=2))
    settings = dict(rounds=2, target_s=0.01, loader_batches=2, malloc_scaling=False,
                    profile=True, zero_params=3000, zero_devices=(2,))
    r = run.measure({"2dev": bench, "2dev+malloc": bench}, settings)
    return {**r, "settings": settings, "generated": "now", "command": "pytest",
            "started": 0.0, "load_before": (0, 0, 0), "notes": ["a note"],
            "commands": {"2dev": "python -m benchmarks.worker"}}


@pytest.fixture(scope="module")
def block(results):
    """The generated block of BENCHMARKS.md from these results (every table of run.TABLES;
    the tables that measure in their own processes are stubbed: their own tests run them)."""
    from benchmarks import overhead
    from benchmarks.harness import run
    stub = "| {} | value |\n| --- | --- |\n| stub | 1 |\n"
    with pytest.MonkeyPatch.context() as patch:
        for name in ("bench_input", "bench_checkpoint", "bench_progress",
                     "bench_coordination", "layouts", "ft"):
            patch.setitem(sys.modules, f"benchmarks.{name}", types.SimpleNamespace(
                table=lambda name=name: stub.format(name)))
        patch.setattr(overhead, "table", lambda **_: stub.format("overhead"))
        return run.render(results)


def tables(markdown: str) -> list[list[list[str]]]:
    """Every markdown table of a text, as rows of cells (header first, separator dropped)."""
    out, current = [], []
    for line in markdown.splitlines() + [""]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and set(cells) != {"---"}:
            current.append(cells)
        elif current and not line.startswith("|"):
            out.append(current)
            current = []
    return out


@pytest.mark.long
def test_every_sample_is_finite_and_positive(results):
    assert {"2dev:jdp", "2dev:hand", "2dev:loader", "2dev:jdp/hand"} <= set(results["samples"])
    for key, values in results["samples"].items():
        assert len(values) == 2 and all(math.isfinite(v) and v > 0 for v in values), key


def one_all_reduce_of_the_trees(h: dict) -> bool:
    """One all-reduce of the gradient, BN statistics and metrics, plus a few scalars at most
    (jdp's stop flag rides along)."""
    return h["ops"] == 1 and 0 <= h["bytes"] - h["expected_bytes"] <= 16


@pytest.mark.long
def test_one_all_reduce_of_the_gradient_stats_and_metrics_on_both_layouts(results):
    for key in ("2dev:jdp", "2dev:pmap", "2dev:maxpool"):
        assert one_all_reduce_of_the_trees(results["hlo"][key]), (key, results["hlo"][key])


@pytest.mark.long
def test_profile_finds_convolutions_and_the_all_reduce(results):
    profile = results["profile"]["2dev:jdp"]
    assert profile["convolution"] > 0 and profile["all-reduce"] > 0


@pytest.mark.long
def test_every_table_renders_well_formed_with_finite_numbers(block):
    from benchmarks.harness import run
    for title, _ in run.TABLES:
        assert f"### {title}" in block
    assert "Failed:" not in block
    found = tables(block)
    assert len(found) >= 10
    for rows in found:
        assert all(len(row) == len(rows[0]) for row in rows[1:]), rows
        for row in rows[1:]:
            for cell in row:
                assert not re.search(r"\b(nan|inf)\b", cell.lower()), (cell, rows[0])
                for number in NUMBER.findall(cell.replace("1/N", "")):
                    assert math.isfinite(float(number.replace(",", ""))), (cell, rows[0])


@pytest.mark.long
def test_sharded_state_at_rest_is_the_share_adam_predicts_in_the_table(block):
    """ZeRO keeps the parameters whole and 1/N of Adam's two moments: (1 + 2/N) / 3 of the
    replicated bytes; FSDP keeps 1/N of all three (at most 1 % more: padding, the count)."""
    found = tables(block.split("### 9. ")[1].split("###")[0])
    header, *rows = found[0]
    mode, share, n = (header.index(k) for k in ("mode", "at rest / replicated", "1/N"))
    assert {row[mode] for row in rows} == {"replicated", "ZeRO", "FSDP", "FSDP bf16",
                                           "FSDP bf16 + bf16 grads"}
    for row in rows:
        expected = {"replicated": 1.0, "ZeRO": (1 + 2 * float(row[n])) / 3}.get(
            row[mode], float(row[n]))
        assert expected <= float(row[share]) <= expected + 0.01, row


def test_zero_table_measures_the_bytes_adam_and_the_collectives_predict():
    """Per device on the 8 test devices, from the model's size alone: bytes at rest of every
    mode, the collectives' bytes, and a peak that holds one whole gathered copy of this
    unrolled model under FSDP (whose gathers the compiler places: none in the lowered program,
    the whole model's in the compiled one)."""
    import jax

    from benchmarks import zero
    n, got = jax.device_count(), zero.measure(3000, steps=1, rounds=1)
    p = 3 * 24 * 24  # three 24 x 24 layers; 24 rows split evenly over 8 devices
    f32, count = 4 * p, 4  # one float32 copy of the parameters; Adam's int32 step count
    rest = {"replicated": 3 * f32, "ZeRO": f32 + 2 * f32 // n}
    for mode, f in got.items():
        assert f["params"] == p
        assert f["rest"] == rest.get(mode, 3 * f32 // n) + count, mode
        assert f["rest"] <= f["peak"] and math.isfinite(f["ms"]) and f["ms"] > 0, mode
    assert f32 <= got["replicated"]["all-reduce"] <= f32 + 16  # + the loss and the stop flag
    assert got["ZeRO"]["lowered reduce-scatter"] == f32 // n
    for mode in ("FSDP", "FSDP bf16", "FSDP bf16 + bf16 grads"):
        f = got[mode]
        assert (f["lowered all-gather"], f["lowered reduce-scatter"]) == (0, 0), mode
        assert f["all-gather"] >= f32, mode  # compiled: XLA:CPU gathers bf16 widened to f32
        assert f["peak"] >= f["rest"] + f32, mode  # the whole model, gathered
        assert f["peak"] < got["replicated"]["peak"], mode
    assert zero.largest(got["FSDP"], "rest") == pytest.approx(
        n * zero.largest(got["replicated"], "rest"), rel=0.01)


def test_host_overhead_rows_are_finite_and_jdp_does_the_same_math_as_jax_jit():
    from benchmarks import overhead
    row = overhead.measure(leaves=3, reps=2, steps=5)
    assert row["leaves"] == 3 and all(
        math.isfinite(row[k]) and row[k] > 0 for k in ("jdp_us", "jit_us", "ratio"))
    steps = overhead._setup(3)
    (jdp_step, jdp_state, jdp_batch), (hand, state, batch) = steps["jdp"], steps["jax.jit"]
    jdp_state, _ = jdp_step(jdp_state, jdp_batch)
    state, _ = hand(state, batch)
    for a, b in zip(jax_leaves(jdp_state.params), jax_leaves(state.params), strict=True):
        assert abs(float(a.sum()) - float(b.sum())) < 1e-6


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)


def test_splice_replaces_only_the_generated_block():
    from benchmarks.harness.report import BEGIN, END, splice
    old = f"# title\n\nhand intro\n\n{BEGIN}\nold tables\n{END}\n\n## Analysis\nhand text\n"
    new = splice(old, "new tables")
    assert new == old.replace("old tables", "new tables")
    assert BEGIN in splice(None, "x") and END in splice(None, "x")


def test_collective_parser_reads_tuple_async_and_sharded_forms():
    from benchmarks.harness import hlo
    text = textwrap.dedent("""\
        %all-reduce = (f32[3,4]{1,0}, /*index=1*/bf16[8]{0}, f32[]) all-reduce(%a, %b, %c)
        %ars = f32[10]{0} all-reduce-start(%d), replica_groups={}
        %ard = f32[10]{0} all-reduce-done(%ars)
        %rs = f32[5]{0} reduce-scatter(%e), dimensions={0}
        ROOT %ag = f32[10]{0} all-gather(%rs), dimensions={0}
        %x = f32[2]{0} add(%y, %z)""")
    found = hlo.collectives(text)
    assert found["all-reduce"] == hlo.Collective(ops=2, bytes=48 + 16 + 4 + 40, arrays=4)
    assert found["reduce-scatter"] == hlo.Collective(1, 20, 1)
    assert found["all-gather"] == hlo.Collective(1, 40, 1)
    # ring traffic on 2 devices: reduce-scatter + all-gather of 40 bytes = an all-reduce of 40
    only_ar = {**found, "all-reduce": hlo.Collective(1, 40, 1),
               "reduce-scatter": hlo.Collective(), "all-gather": hlo.Collective()}
    sharded = {**found, "all-reduce": hlo.Collective()}
    assert hlo.ring_bytes(only_ar, 2) == hlo.ring_bytes(sharded, 2) == 40


def test_protocol_round_trip_with_a_child_process(tmp_path):
    from benchmarks import harness
    child = ("import sys; from benchmarks import harness; harness.serve(sys.argv[1], "
             "{'double': lambda r: {'x': 2 * r['x']}}, primary=True, info={'hi': 1})")
    worker = harness.Worker("child", [sys.executable, "-c", child, str(tmp_path)],
                             child_env(), str(tmp_path), REPO)
    try:
        assert worker.wait_ready(timeout=60) == {"hi": 1}
        assert worker.request(op="double", x=21) == {"x": 42}
        with pytest.raises(RuntimeError, match="KeyError"):
            worker.request(op="missing")
    finally:
        worker.stop()
    assert worker.proc.returncode == 0


def test_interleaved_rounds_alternate_order_and_ratios_pair_rounds():
    from benchmarks import harness
    from benchmarks.harness import report
    calls = []
    harness.interleave(lambda k: calls.append(k) or {"a": 2.0, "b": 1.0}[k], ["a", "b"], 3)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert report.ratio({"samples": {"a": [2, 9, 4], "b": [1, 3, 4]}}, "a", "b") == 2.0


@pytest.mark.long
def test_the_one_gpu_table_runs_on_one_cpu_device_and_is_exact():
    """`python -m benchmarks.gpu` at a tiny size in a child with one CPU device: six rows of
    finite times, and jdp's parameters after 3 steps equal the hand-written jax.jit step's:
    float32 bit for bit, bf16 to float32 rounding (1.5e-8 here; on the H200 both were
    bitwise)."""
    import subprocess
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--width", "16", "--layers",
                           "2", "--batch", "64", "--steps", "2", "--reps", "1"], cwd=REPO,
                          env=child_env(1), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()
            if line.startswith("| ") and line[2].isalpha() and "placement" not in line]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        (p, d) for d in ("float32", "bf16") for p in ("replicated", "ZeRO", "FSDP")], done.stdout
    for r in rows:
        assert all(float(x) > 0 for x in r[2:5]), r
        assert float(r[5]) == 0.0 if r[1].strip() == "float32" else float(r[5]) < 1e-6, r


@pytest.mark.long
def test_the_unrolled_fsdp_benchmark_measures_every_mode():
    """benchmarks/fsdp_unrolled.py at a toy size: AdamW's state is twice the parameters, so
    replicated holds 3 x 4 bytes per parameter at rest (and Adam's int32 count) and FSDP about
    an eighth of it."""
    from benchmarks import fsdp_unrolled

    found = fsdp_unrolled.measure(layers=2, width=32, steps=1)
    assert len(found) == 5
    replicated = found["replicated"]
    assert replicated["rest"] == 12 * replicated["params"] + 4
    per_layer = found["FSDP, one layer at a time (default)"]
    assert per_layer["rest"] <= replicated["rest"] / 8 * 1.1
    assert all(f["peak"] > 0 and f["ms"] > 0 for f in found.values())
