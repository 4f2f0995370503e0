"""Across processes (2 ranks x 2 devices under `python -m jdp.launch`, and mpirun): a global
array assembled from per-process pieces (jdp.shard, the Loader) agrees on shape and dtype, once
per new signature, named on every rank in seconds; typed keys and FSDP leaves split over
processes cross processes intact (the single-process cases are in test_misuse_forms and
test_misuse_nnx)."""
import re
import subprocess

import pytest
from conftest import (
    MPIRUN,
    REPO,
    job_env,
    mpirun_command,
    run_python,
    wait_until_gone,
    write_script,
)

RANKS = """
import json, sys, time
import jax, numpy as np, optax
import jdp
from flax import nnx
from jax.experimental import multihost_utils
from jdp.job import rank

jdp.initialize()
r = jax.process_index()


def case(name, fn):
    start = time.monotonic()
    try:
        outcome = "ok " + json.dumps(fn())
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    print(f"CASE {name} {time.monotonic() - start:.2f} {outcome}", flush=True)


def shard(mine, theirs):
    return lambda: list(jdp.shard({"x": mine if r == 0 else theirs})["x"].shape)


def loader(mine, theirs):
    source = {"x": mine if r == 0 else theirs}
    return lambda: list(next(iter(jdp.data.Loader(source, batch_size=4)))["x"].shape)


def shard_repeatedly():
    for _ in range(5):
        jdp.shard({"x": np.zeros((4, 3), np.float32)})
    return rank.current().agreement.rounds.get("shard")


def fsdp_checkpoint():
    rows = np.arange(2.0, 2.0 + jax.device_count())[:, None]   # one row per device
    state = jdp.TrainState.create(apply_fn=None, params={"w": rows}, tx=optax.sgd(0.1))
    ckpt = jdp.checkpoint.Checkpointer(sys.argv[1])
    ckpt.save(1, jdp.broadcast(state, shard_params=True).params)
    template = jdp.broadcast(state.replace(params={"w": np.zeros_like(rows)}), shard_params=True)
    back = ckpt.restore(template.params)["w"]
    assert not back.is_fully_addressable   # split across the processes
    whole = multihost_utils.process_allgather(back, tiled=True)   # every row, here
    return np.asarray(whole).ravel().tolist()


def dropout_key():
    rest = nnx.split(nnx.Dropout(0.5, rngs=nnx.Rngs(7 + r)), ...)[1]   # rank 1 seeded apart
    key = jdp.broadcast(rest)["rngs"]["key"].get_value()
    return np.asarray(jax.random.key_data(key)).tolist()


f32 = np.float32
case("shard_rows", shard(np.zeros((4, 3), f32), np.zeros((2, 3), f32)))
case("shard_dtype", shard(np.zeros((4, 3), f32), np.zeros((4, 3), np.int32)))
case("loader_field", loader(np.zeros((16, 3), f32), np.zeros((16, 5), f32)))
case("loader_dtype", loader(np.zeros((16, 3), f32), np.zeros((16, 3), np.int32)))
case("shard_agreeing", shard(np.zeros((4, 3), f32), np.ones((4, 3), f32)))
case("shard_once", shard_repeatedly)
case("fsdp_checkpoint", fsdp_checkpoint)
case("dropout_key", dropout_key)
"""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """{(rank, case): (seconds, outcome)} of one 2-rank job running every case."""
    import uuid
    tmp, tag = tmp_path_factory.mktemp("pieces"), uuid.uuid4().hex
    script = write_script(tmp, "pieces.py", RANKS)
    done = run_python(["-m", "jdp.launch", "--nproc_per_node", "2", "--devices_per_process",
                       "2", script, str(tmp / "ckpt")], env=job_env(tag), timeout=240)
    wait_until_gone(tag, timeout=10)
    found = {}
    for line in done.stdout.splitlines() + done.stderr.splitlines():
        m = re.match(r"\[rank(\d)\]: CASE (\S+) (\S+) (.*)$", line)
        if m:
            found[int(m[1]), m[2]] = (float(m[3]), m[4])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return found


def both(outcomes, name):
    got = [outcomes.get((rank, name)) for rank in (0, 1)]
    assert None not in got, (name, sorted(outcomes))
    return got


@pytest.mark.parametrize("name, who, words", [
    ("shard_rows", "jdp.shard", "['x']: float32[8, 3] on process(es) 0 but float32[4, 3] on "
                                "process(es) 1"),
    ("shard_dtype", "jdp.shard", "['x']: float32[8, 3] on process(es) 0 but int32[8, 3]"),
    ("loader_field", "jdp.data.Loader", "['x']: float32[8, 3] on process(es) 0 but "
                                        "float32[8, 5] on process(es) 1"),
    ("loader_dtype", "jdp.data.Loader", "['x']: float32[8, 3] on process(es) 0 but int32[8, 3]"),
])
def test_pieces_that_differ_between_ranks_are_named_on_every_rank(outcomes, name, who, words):
    for seconds, outcome in both(outcomes, name):
        assert outcome.startswith(f"ValueError: {who}: the processes disagree on "), outcome
        assert words in outcome, outcome
        assert seconds < 60, seconds


def test_agreeing_pieces_make_one_global_batch_checked_once_per_signature(outcomes):
    for _, outcome in both(outcomes, "shard_agreeing"):
        assert outcome == "ok [8, 3]", outcome
    # shard_rows, shard_dtype, shard_agreeing each agreed once; five more calls of the agreed
    # signature ask nothing.
    assert [o for _, o in both(outcomes, "shard_once")] == ["ok 3", "ok 3"]


def test_an_fsdp_leaf_split_over_two_processes_saves_and_restores_every_row(outcomes):
    assert [o for _, o in both(outcomes, "fsdp_checkpoint")] == ["ok [2.0, 3.0, 4.0, 5.0]"] * 2


def test_a_dropout_key_is_broadcast_from_process_0_to_every_rank(outcomes):
    (_, zero), (_, one) = both(outcomes, "dropout_key")
    assert zero == one and zero.startswith("ok ["), (zero, one)


UNDER_MPIRUN = """
import time
import jax, numpy as np
import jdp

jdp.initialize()
r = jax.process_index()
start = time.monotonic()
try:
    jdp.shard({"x": np.zeros((4 if r == 0 else 2, 3), np.float32)})
except Exception as e:
    print(f"rank {r} after {time.monotonic() - start:.1f} s: {type(e).__name__}: {e}", flush=True)
"""


@pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI) is not installed")
def test_under_mpirun_pieces_that_differ_are_named_on_both_ranks(tmp_path, tag):
    script = write_script(tmp_path, "mpi.py", UNDER_MPIRUN)
    done = subprocess.run(mpirun_command(script, ("JAX_PLATFORMS", "PYTHONPATH",
                                                  "JDP_TEST_TAG", "XLA_FLAGS")),
                          env=job_env(tag), cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    found = re.findall(r"rank (\d) after ([\d.]+) s: ValueError: jdp\.shard: the processes "
                       r"disagree on \['x'\]: float32\[8, 3\] on process\(es\) 0 but "
                       r"float32\[4, 3\] on process\(es\) 1", done.stdout)
    assert sorted(rank for rank, _ in found) == ["0", "1"], done.stdout + done.stderr
    assert all(float(seconds) < 60 for _, seconds in found), done.stdout
