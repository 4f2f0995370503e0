"""Ranks that disagree, values that must arrive exactly, a job nobody joined: 2 ranks under
`python -m jdp.launch` on 127.0.0.1.

One job runs every case in turn (each rank prints `CASE <name> <seconds> <outcome>`), so the
cases cost one launch; each case is then its own test. A disagreement must raise on every rank,
within seconds, naming what differs and on which processes; host values must arrive bit for bit.
"""
import json
import re
import subprocess

import numpy as np
import pytest
from conftest import (
    MPIRUN,
    REPO,
    assert_one_line,
    job_env,
    mpirun_command,
    run_python,
    wait_until_gone,
    write_script,
)

import jdp

RANKS = """
import json, sys, time
import jax, ml_dtypes, numpy as np
import jdp

jdp.initialize()
r = jax.process_index()


def case(name, fn):
    start = time.monotonic()
    try:
        outcome = "ok " + json.dumps(fn())
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    print(f"CASE {name} {time.monotonic() - start:.2f} {outcome}", flush=True)


def broadcast(mine, theirs):
    return lambda: jdp.broadcast_from_primary(mine if r == 0 else theirs) and None


def loader(mine, theirs, data=16):
    def run():
        kwargs = mine if r == 0 else theirs
        n = kwargs.pop("n", data)
        batch = next(iter(jdp.data.Loader({"x": np.arange(n, dtype=np.float32)}, **kwargs)))
        return int(np.asarray(batch["x"].addressable_data(0)).sum())
    return run


z = np.zeros
case("shape", broadcast({"w": z(3, np.float32)}, {"w": z(4, np.float32)}))
case("dtype", broadcast({"w": z(3, np.float32)}, {"w": z(3, np.float64)}))
case("keys", broadcast({"w": z(3)}, {"v": z(3)}))
case("extra_leaf", broadcast({"w": z(3)}, {"w": z(3), "b": z(2)}))
case("nested", broadcast({"a": {"k": z((3, 2))}}, {"a": {"k": z((2, 3))}}))
case("list_length", broadcast([z(2), z(2)], [z(2), z(2), z(2)]))
case("scalar_vs_vector", broadcast({"s": 1.0}, {"s": z(1)}))
case("string_length", broadcast({"s": "relu"}, {"s": "gelu2"}))
case("same_tree_after_errors", lambda: float(jdp.broadcast_from_primary(
    {"w": np.full(3, 7.0 + r)})["w"].sum()))

VALUES = {"int64": np.int64(2**40 + 3), "float64_big": np.float64(1e300),
          "float64_tenth": np.float64(0.1), "bool": np.array([True, False, True]),
          "uint8": np.arange(250, 256, dtype=np.uint8), "int8": np.array([-128, 127], np.int8),
          "uint64": np.uint64(2**64 - 1), "complex128": np.complex128(1e300 + 0.1j),
          "float16": np.float16(65504), "bfloat16": np.array([1.5, -3.25], ml_dtypes.bfloat16),
          "negative_zero": np.float32(-0.0),
          "nan_payload": np.array([0x7FC00001], np.uint32).view(np.float32),
          "python_int": 2**40 + 3, "python_float": 0.1, "empty": np.zeros((0, 3)),
          "matrix": np.arange(12, dtype=np.float64).reshape(3, 4) / 3}
garbled = {k: np.asarray(v) + np.asarray(v).dtype.type(1) if np.asarray(v).dtype != bool
           else ~np.asarray(v) for k, v in VALUES.items()}
case("values", lambda: {k: [str(v.dtype), list(v.shape), np.ascontiguousarray(v).tobytes().hex()]
                        for k, v in jdp.broadcast_from_primary(
                            VALUES if r == 0 else garbled).items()})

case("loader_num_examples", loader({"batch_size": 4}, {"batch_size": 4, "n": 20}))
case("loader_batch_size", loader({"batch_size": 4}, {"batch_size": 8}))
case("loader_seed", loader({"batch_size": 4, "shuffle": True, "seed": 1},
                           {"batch_size": 4, "shuffle": True, "seed": 2}))
case("loader_shuffle", loader({"batch_size": 4, "shuffle": True}, {"batch_size": 4}))
case("loader_drop_last", loader({"batch_size": 4, "drop_last": True}, {"batch_size": 4}))
case("loader_layout", loader({"batch_size": 4}, {"batch_size": 4, "layout": "pmap"}))
case("loader_agreeing", loader({"batch_size": 4}, {"batch_size": 4}))

ckpt = jdp.checkpoint.Checkpointer(sys.argv[1])
state = jdp.broadcast({"w": z(3), "extra": z(2)})
case("checkpoint_tree", lambda: ckpt.save(1, {"w": state["w"]} if r == 0 else state))


def different_paths():          # rank 1 broadcasts once more; rank 0 goes on to its Loader
    if r == 1:
        jdp.broadcast_from_primary({"w": z(3)})
    return loader({"batch_size": 4}, {"batch_size": 4})()


case("different_paths", different_paths)         # last: the job's calls no longer pair up
"""

CASES = ["shape", "dtype", "keys", "extra_leaf", "nested", "list_length", "scalar_vs_vector",
         "string_length"]
LOADER_CASES = ["loader_num_examples", "loader_batch_size", "loader_seed", "loader_shuffle",
                "loader_drop_last", "loader_layout"]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """{(rank, case): (seconds, outcome)} of one 2-rank job running every case."""
    import uuid
    tmp, tag = tmp_path_factory.mktemp("ranks"), uuid.uuid4().hex
    script = write_script(tmp, "ranks.py", RANKS)
    done = run_python(["-m", "jdp.launch", "--nproc_per_node", "2", script, str(tmp / "ckpt")],
                      env=job_env(tag), timeout=240)
    wait_until_gone(tag, timeout=10)
    found = {}
    for line in done.stdout.splitlines() + done.stderr.splitlines():
        m = re.match(r"\[rank(\d)\]: CASE (\S+) (\S+) (.*)$", line)
        if m:
            found[int(m[1]), m[2]] = (float(m[3]), m[4])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return found


def _both(outcomes, name):
    got = [outcomes.get((rank, name)) for rank in (0, 1)]
    assert None not in got, (name, sorted(outcomes))
    return got


def _named_on_both(outcomes, name, who, words, fix):
    """Both ranks raised, within 60 s, one ValueError from `who` naming `words` and `fix`."""
    for seconds, outcome in _both(outcomes, name):
        assert outcome.startswith(f"ValueError: {who}: the processes disagree on "), outcome
        assert all(w in outcome for w in words), outcome
        assert fix in outcome, outcome
        assert seconds < 60, seconds


@pytest.mark.parametrize("name, words", [
    ("shape", ["['w']: float32[3] on process(es) 0 but float32[4] on process(es) 1"]),
    ("dtype", ["['w']: float32[3] on process(es) 0 but float64[3] on process(es) 1"]),
    ("keys", ["['w']: float64[3] on process(es) 0 but absent on process(es) 1"]),
    ("extra_leaf", ["['b']: absent on process(es) 0 but float64[2] on process(es) 1"]),
    ("nested", ["['a']['k']: float64[3, 2] on process(es) 0 but float64[2, 3]"]),
    ("list_length", ["[2]: absent on process(es) 0 but float64[2] on process(es) 1"]),
    ("scalar_vs_vector", ["['s']: float64[] on process(es) 0 but float64[1]"]),
    ("string_length", ["['s']: <U4[] on process(es) 0 but <U5[] on process(es) 1"]),
])
def test_a_tree_that_differs_between_ranks_raises_on_every_rank(outcomes, name, words):
    _named_on_both(outcomes, name, "jdp.broadcast_from_primary", words,
                   "every process must build the same tree")


def test_the_job_goes_on_after_a_disagreement(outcomes):
    assert [o for _, o in _both(outcomes, "same_tree_after_errors")] == ["ok 21.0"] * 2


def _expected_values():
    import ml_dtypes
    return {"int64": np.int64(2**40 + 3), "float64_big": np.float64(1e300),
            "float64_tenth": np.float64(0.1), "bool": np.array([True, False, True]),
            "uint8": np.arange(250, 256, dtype=np.uint8), "int8": np.array([-128, 127], np.int8),
            "uint64": np.uint64(2**64 - 1), "complex128": np.complex128(1e300 + 0.1j),
            "float16": np.float16(65504), "bfloat16": np.array([1.5, -3.25], ml_dtypes.bfloat16),
            "negative_zero": np.float32(-0.0),
            "nan_payload": np.array([0x7FC00001], np.uint32).view(np.float32),
            "python_int": np.int64(2**40 + 3), "python_float": np.float64(0.1),
            "empty": np.zeros((0, 3)), "matrix": np.arange(12, dtype=np.float64).reshape(3, 4) / 3}


@pytest.mark.parametrize("key", sorted(_expected_values()))
def test_host_values_arrive_bit_for_bit_on_every_rank(outcomes, key):
    want = np.asarray(_expected_values()[key])
    for _, outcome in _both(outcomes, "values"):
        assert outcome.startswith("ok "), outcome
        dtype, shape, hexed = json.loads(outcome[3:])[key]
        assert (dtype, tuple(shape)) == (str(want.dtype), want.shape)
        assert hexed == np.ascontiguousarray(want).tobytes().hex(), (key, hexed)


@pytest.mark.parametrize("name, words", [
    ("loader_num_examples", ["num_examples: 16 on process(es) 0 but 20 on process(es) 1"]),
    ("loader_batch_size", ["batch_size: 4 on process(es) 0 but 8 on process(es) 1"]),
    ("loader_seed", ["seed: 1 on process(es) 0 but 2 on process(es) 1"]),
    ("loader_shuffle", ["shuffle: True on process(es) 0 but False on process(es) 1"]),
    ("loader_drop_last", ["drop_last: True on process(es) 0 but False on process(es) 1"]),
    ("loader_layout", ["layout: global on process(es) 0 but pmap on process(es) 1"]),
])
def test_loaders_that_differ_between_ranks_raise_on_every_rank(outcomes, name, words):
    _named_on_both(outcomes, name, "jdp.data.Loader", words, "on every process")


def test_agreeing_loaders_give_each_rank_its_own_rows(outcomes):
    # 16 examples, 2 ranks, batch 4, no shuffle: rank r reads 0+r, 2+r, 4+r, 6+r.
    assert [o for _, o in _both(outcomes, "loader_agreeing")] == ["ok 12", "ok 16"]


def test_a_checkpoint_of_different_trees_is_refused_on_every_rank(outcomes):
    for seconds, outcome in _both(outcomes, "checkpoint_tree"):
        assert outcome == ("ValueError: Checkpointer.save: the processes disagree on extra: "
                           "absent on process(es) 0 but float32[2] on process(es) 1; every "
                           "process must call save with the same step and state on one shared "
                           "directory (the same path on every process)"), outcome
        assert seconds < 60


def test_ranks_that_take_different_paths_name_where_each_waits(outcomes):
    (t0, rank0), (t1, rank1) = _both(outcomes, "different_paths")
    # the 8th Loader agreement on rank 0; rank 1's 12th broadcast, which rank 0 never made
    assert rank0.startswith("RuntimeError: jdp.data.Loader: process 0 waits here (call 8) "
                            "while process 1 waits in jdp.broadcast_from_primary (call 12), "
                            "which process 0 has not reached"), rank0
    assert rank1.startswith("RuntimeError: jdp.broadcast_from_primary: process 1 waits here "
                            "(call 12) while process 0 waits in jdp.data.Loader (call 8), which "
                            "process 1 has not reached"), rank1
    for outcome in (rank0, rank1):
        assert "the processes took different paths through the program" in outcome
    assert max(t0, t1) < 10


NO_INIT = """
import sys
import numpy as np
import jdp
what = sys.argv[1]
if what == "broadcast":
    jdp.broadcast_from_primary({"w": np.zeros(3)})
elif what == "loader":
    jdp.data.Loader({"x": np.zeros(8)}, batch_size=4)
else:
    jdp.checkpoint.Checkpointer(sys.argv[2])
print("trained alone", flush=True)
"""


@pytest.mark.parametrize("what, who", [("broadcast", "jdp.broadcast_from_primary"),
                                       ("loader", "jdp.data.Loader"),
                                       ("checkpointer", "jdp.checkpoint.Checkpointer")])
def test_a_launched_script_without_initialize_fails_on_its_first_jdp_call(tmp_path, tag, what,
                                                                          who):
    script = write_script(tmp_path, "alone.py", NO_INIT)
    done = run_python(["-m", "jdp.launch", "--nproc_per_node", "2", script, what,
                       str(tmp_path / "ckpt")], env=job_env(tag), timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "trained alone" not in out
    assert (f"RuntimeError: {who}: this process runs under a launcher (WORLD_SIZE=2, RANK=" in
            out), out
    assert "but jdp.initialize() was not called" in out


@pytest.fixture
def launched(monkeypatch):
    """This process looks like one rank of a launched job that never called jdp.initialize()."""
    from jdp.job import rank
    from jdp.job.env import RANK_VARS
    for name in (*RANK_VARS, "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID",
                 "SLURM_NTASKS", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE",
                 "JDP_CLUSTER_DETECTION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(rank.current().agreement, "job_checked", False)
    return monkeypatch


JOBS = {
    "launcher": ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": "29500"}, "WORLD_SIZE=2, RANK=1"),
    "incomplete": ({"WORLD_SIZE": "4"}, "WORLD_SIZE=4"),
    "slurm": ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "0",
               "SLURM_NTASKS": "2"}, "SLURM_NTASKS=2"),
    "mpirun": ({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"},
               "OMPI_COMM_WORLD_SIZE=2"),
    "asked": ({"JDP_CLUSTER_DETECTION": "slurm"}, "JDP_CLUSTER_DETECTION=slurm"),
}
ENTRY_POINTS = {
    "jdp.broadcast_from_primary": lambda tmp: jdp.broadcast_from_primary({"w": np.zeros(2)}),
    "jdp.data.Loader": lambda tmp: jdp.data.Loader({"x": np.zeros(8)}, batch_size=8),
    "jdp.data.DistributedSampler": lambda tmp: jdp.data.DistributedSampler(8),
    "jdp.checkpoint.Checkpointer": lambda tmp: jdp.checkpoint.Checkpointer(tmp / "c"),
}


@pytest.mark.parametrize("job", sorted(JOBS))
@pytest.mark.parametrize("who", sorted(ENTRY_POINTS))
def test_a_job_that_was_never_joined_is_refused_by_every_entry_point(launched, tmp_path, job,
                                                                     who):
    variables, named = JOBS[job]
    for name, value in variables.items():
        launched.setenv(name, value)
    with pytest.raises(RuntimeError) as info:
        ENTRY_POINTS[who](tmp_path)
    assert_one_line(info.value, [f"{who}: this process runs under a launcher ({named}",
                                 "jdp.initialize() was not called",
                                 "call jdp.initialize() first in main"])


def test_one_process_passes_and_the_check_is_not_repeated(launched, tmp_path):
    # private: the internals this test checks have no public name
    from jdp.distributed import _group
    launched.setenv("WORLD_SIZE", "1")
    jdp.data.Loader({"x": np.zeros(8)}, batch_size=8)
    launched.setattr(_group, "_launcher_variables", None)   # would fail if called again
    for who in ENTRY_POINTS.values():
        who(tmp_path)


UNDER_MPIRUN = """
import sys, time
import jax, numpy as np
import jdp

if sys.argv[1] == "join":
    jdp.initialize()
r = jax.process_index()
start = time.monotonic()
try:
    jdp.broadcast_from_primary({"w": np.zeros(3 if r == 0 else 4)})
except Exception as e:
    print(f"rank {r} after {time.monotonic() - start:.1f} s: {type(e).__name__}: {e}", flush=True)
"""


@pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI) is not installed")
@pytest.mark.parametrize("join", ["join", "forget"])
def test_under_mpirun_a_disagreement_or_a_missing_initialize_is_named(tmp_path, tag, join):
    script = write_script(tmp_path, "mpi.py", UNDER_MPIRUN)
    env = job_env(tag)
    done = subprocess.run(mpirun_command(script, ("JAX_PLATFORMS", "PYTHONPATH",
                                                  "JDP_TEST_TAG", "XLA_FLAGS"), join),
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    if join == "join":
        # mpirun forwards both ranks' stdout to one stream: their lines may run together
        found = re.findall(r"rank (\d) after ([\d.]+) s: ValueError: jdp\.broadcast_from_primary: "
                           r"the processes disagree on \['w'\]: float64\[3\] on process\(es\) 0 "
                           r"but float64\[4\] on process\(es\) 1", done.stdout)
        assert sorted(rank for rank, _ in found) == ["0", "1"], out
        assert all(float(seconds) < 60 for _, seconds in found), out
    else:
        assert out.count("RuntimeError: jdp.broadcast_from_primary: this process runs under a "
                         "launcher (OMPI_COMM_WORLD_SIZE=2) but jdp.initialize() was not "
                         "called") == 2, out      # on both ranks
