"""The benchmark suite's pieces at a tiny size: they run and give sane numbers.

No timing is asserted (the machines are shared); only that the figures are finite and
positive, that the compiled step all-reduces exactly the bytes the trees predict, and that the
request protocol and the report work. The full suite is `make bench`.
"""
import json
import math
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from conftest import REPO, child_env


@pytest.fixture(scope="module")
def bench():
    """A worker's benchmark object on the 8 test devices, 2 examples per device."""
    from benchmarks import worker
    return worker.Bench(["jdp", "hand", "shardmap"], per_device=2)


def test_timed_steps_give_finite_positive_throughput(bench):
    for variant in ("jdp", "hand", "shardmap"):
        result = bench.time({"variant": variant, "steps": 2})
        assert result["samples"] == 2 * 2 * jax.device_count()
        assert math.isfinite(result["seconds"]) and result["seconds"] > 0
        assert result["faults_per_step"] >= 0
    ratio = bench.paired({"a": "jdp", "b": "hand", "steps": 1, "reps": 2})["ratio"]
    assert math.isfinite(ratio) and ratio > 0


@pytest.mark.parametrize("variant", ["jdp", "shardmap"])
def test_one_all_reduce_of_exactly_the_gradient_stats_and_metrics(bench, variant):
    found = bench.hlo({"variant": variant})
    state = jax.tree.map(lambda x: np.asarray(x)[0], bench.variants["jdp"].state)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    stats_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.model_state))
    assert found["ops"] == 1
    assert found["bytes"] == param_bytes + stats_bytes + 4 * 2  # loss and accuracy, float32
    assert found["expected_bytes"] == found["bytes"]


def test_all_reduce_parser_reads_tuple_and_async_forms():
    from benchmarks import hlo
    text = textwrap.dedent("""\
        %all-reduce = (f32[3,4]{1,0}, /*index=1*/bf16[8]{0}, f32[]) all-reduce(%a, %b, %c)
        %ars = f32[10]{0} all-reduce-start(%d), replica_groups={}
        %ard = f32[10]{0} all-reduce-done(%ars)
        %x = f32[2]{0} add(%y, %z)""")
    assert hlo.all_reduces(text) == hlo.AllReduces(ops=2, bytes=48 + 16 + 4 + 40, arrays=4)


def test_profile_classifies_ops_by_what_they_compute(bench):
    from benchmarks import profile
    variant = bench.variants["jdp"]
    text = variant.step.lower(variant.state, bench.batch).compile().as_text()
    kinds = profile.op_kinds(text)
    assert {"convolution", "all-reduce"} <= set(kinds.values())


def test_protocol_round_trip_with_a_child_process(tmp_path):
    from benchmarks import protocol
    child = ("import sys; from benchmarks import protocol; protocol.serve(sys.argv[1], "
             "{'double': lambda r: {'x': 2 * r['x']}}, primary=True, info={'hi': 1})")
    worker = protocol.Worker("child", [sys.executable, "-c", child, str(tmp_path)],
                             child_env(), str(tmp_path), REPO)
    try:
        assert worker.wait_ready(timeout=60) == {"hi": 1}
        assert worker.request(op="double", x=21) == {"x": 42}
        with pytest.raises(RuntimeError, match="KeyError"):
            worker.request(op="missing")
    finally:
        worker.stop()
    assert worker.proc.returncode == 0


def test_interleaved_rounds_alternate_order_and_report_renders():
    from benchmarks import report, timing
    calls = []
    samples = timing.interleave(lambda k: calls.append(k) or {"a:x": 2.0, "b:y": 1.0}[k],
                                ["a:x", "b:y"], rounds=3)
    assert calls == ["a:x", "b:y", "b:y", "a:x", "a:x", "b:y"]
    assert timing.ratio_median(samples, "a:x", "b:y") == 2.0
    results = {"settings": {"rounds": 3, "target_s": 0.1}, "samples": samples,
               "details": {}, "steps": {}, "jobs": {}, "gradcheck": {}, "notes": ["n"],
               "load_before": (0, 0, 0), "load_after": (0, 0, 0), "seconds": 1.0,
               "command": "python -m benchmarks.run --quick", "hlo": {}, "profile": {}}
    text = report.render(json.loads(json.dumps(results)))
    assert "# jdp benchmarks" in text and "## Analysis" in text


def test_malloc_tuning_applies_in_a_fresh_process():
    code = "from benchmarks import malloc; print(malloc.tune())"
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == ("True" if sys.platform.startswith("linux") else "False")
