"""Misuse that used to work badly or say the wrong thing (issue 40's POOR cases): each is a
one-line error naming the value the user wrote and the fix, a warning, or it simply works."""
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_one_line, one_line_error

import jdp


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _state(shard_params=False):
    rng = np.random.default_rng(0)
    state = jdp.TrainState.create(apply_fn=None, params={"w": rng.normal(size=(8, 4))
                                                         .astype(np.float32)}, tx=optax.sgd(0.1))
    return jdp.broadcast(state, shard_params=shard_params)


def _batch():
    rng = np.random.default_rng(1)
    n = jax.device_count()
    return {"x": rng.normal(size=(2 * n, 8)).astype(np.float32),
            "y": rng.normal(size=(2 * n, 4)).astype(np.float32)}


# --- shard_params: the value the user wrote, numpy scalars taken as their Python value ------

@pytest.mark.parametrize("group", [np.int64(4), np.int32(2)])
def test_a_numpy_integer_shard_params_trains_as_the_plain_int(group):
    host = _batch()
    state = _state(shard_params=group)
    state, _ = jdp.train_step(_loss, shard_params=group)(state, jdp.shard(host))
    w0 = _state().params["w"]
    grad = jax.grad(_loss)({"w": np.asarray(w0)}, host)       # one device, the global batch
    want = np.asarray(w0) - 0.1 * np.asarray(grad["w"])
    np.testing.assert_allclose(np.asarray(jdp.unshard(state).params["w"]), want,
                               rtol=1e-5, atol=1e-6)


def test_a_numpy_bool_shard_params_is_true():
    state = _state(shard_params=np.True_)
    state, _ = jdp.train_step(_loss, shard_params=np.True_)(state, jdp.shard(_batch()))
    assert jdp.unshard(state).params["w"].shape == (8, 4)


def test_a_float_shard_params_is_named_as_a_type_problem():
    one_line_error(TypeError, ["shard_params=4.0", "not a float", "int >= 2"],
                   jdp.train_step, _loss, shard_params=4.0)


def test_a_group_size_step_on_a_replicated_state_names_the_group_written():
    step = jdp.train_step(_loss, shard_params=4)
    error = one_line_error(ValueError, ["shard_params=4:", "not sharded",
                                        "jdp.broadcast(state, shard_params=4)"],
                           step, _state(), jdp.shard(_batch()))
    assert "shard_params=True" not in str(error)


def test_a_step_without_shard_params_on_groups_names_the_groups_placed():
    one_line_error(ValueError, ["parameters are sharded", "shard_params=4"],
                   jdp.train_step(_loss), _state(shard_params=4), jdp.shard(_batch()))


@pytest.mark.parametrize("step_value, words", [
    (True, ["shard_params=True:", "groups of 4 devices", "shard_params=4)", "not all devices"]),
    (2, ["shard_params=2:", "groups of 4 devices", "not groups of 2"]),
])
def test_a_step_with_other_groups_than_the_state_names_both(step_value, words):
    one_line_error(ValueError, words, jdp.train_step(_loss, shard_params=step_value),
                   _state(shard_params=4), jdp.shard(_batch()))


def test_broadcast_of_a_plain_tree_with_a_group_size_names_the_group():
    one_line_error(TypeError, ["jdp.broadcast(shard_params=4)", "no opt_state"],
                   jdp.broadcast, {"w": np.zeros(3)}, shard_params=4)


# --- jdp.evaluate and the Loader: what is not a split, named as what it is ------------------

def _sq(state, batch):
    return {"sq": batch["x"] * state["w"]}


@pytest.mark.parametrize("size", [0, -8])
def test_a_loader_batch_size_below_1_is_refused(size):
    one_line_error(ValueError, [f"batch_size={size}", "int >= 1"],
                   jdp.data.Loader, {"x": np.zeros(16, np.float32)}, batch_size=size)


@pytest.mark.parametrize("size", [0, -8])
def test_evaluate_refuses_a_batch_size_below_1_instead_of_its_default(size):
    one_line_error(ValueError, ["jdp.evaluate", f"batch_size={size}", "int >= 1"],
                   jdp.evaluate, _sq, jdp.broadcast({"w": np.float32(2)}),
                   {"x": np.ones(16, np.float32)}, batch_size=size)


def test_evaluate_names_an_empty_split():
    one_line_error(ValueError, ["jdp.evaluate", "empty (0 examples)"], jdp.evaluate, _sq,
                   jdp.broadcast({"w": np.float32(2)}), {"x": np.ones(0, np.float32)})


def test_evaluate_names_a_list_of_the_loaders_batches():
    n = jax.local_device_count()
    loader = jdp.data.Loader({"x": np.ones(4 * n, np.float32)}, batch_size=2 * n)
    one_line_error(TypeError, ["jdp.evaluate", "list of batches", "Loader"], jdp.evaluate, _sq,
                   jdp.broadcast({"w": np.float32(2)}), list(loader))


def test_evaluate_names_shard_batches_and_an_iterator():
    n = jax.local_device_count()
    batch = jdp.shard({"x": np.ones(2 * n, np.float32)})
    one_line_error(TypeError, ["tuple of batches"], jdp.evaluate, _sq,
                   jdp.broadcast({"w": np.float32(2)}), (batch, batch))
    one_line_error(TypeError, ["list_iterator of batches"], jdp.evaluate, _sq,
                   jdp.broadcast({"w": np.float32(2)}), iter([batch]))


def test_evaluate_still_reads_a_list_of_examples():
    examples = [{"x": np.float32(i)} for i in range(10)]
    got = jdp.evaluate(_sq, jdp.broadcast({"w": np.float32(2)}), examples, batch_size=8)
    assert got == {"sq": 2 * np.mean(np.arange(10)), "count": 10.0}


# --- the environment a job is started with --------------------------------------------------

def _roll_call(ranks, world, timeout=20):
    """Each of `ranks` runs the roll call in a thread of its own: {index: outcome}."""
    from conftest import free_port

    from jdp.distributed import _rendezvous
    port, out = free_port(), {}

    def process(i, rank):
        try:
            conns, _ = _rendezvous.roll_call("127.0.0.1", port, rank, world, timeout)
            for conn in conns.values():
                conn.close()
            out[i] = "joined"
        except Exception as e:  # noqa: BLE001 - the outcome under test
            out[i] = e

    threads = [threading.Thread(target=process, args=(i, r), daemon=True)
               for i, r in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return out, port


def test_two_processes_with_one_rank_are_named_on_every_process_at_once():
    start = time.monotonic()
    out, _ = _roll_call([0, 1, 1], world=3, timeout=30)
    assert time.monotonic() - start < 15          # not process 0's 30 s wait for rank 2
    assert sorted(out) == [0, 1, 2]
    for error in out.values():
        assert isinstance(error, ValueError), out
        assert_one_line(error, ["two processes were started with RANK=1", "its own RANK"])


def test_a_rank_that_reported_and_was_restarted_reports_again():
    from conftest import free_port

    from jdp.distributed import _rendezvous
    from jdp.job import net
    port, out = free_port(), {}

    def process(rank):
        conns, _ = _rendezvous.roll_call("127.0.0.1", port, rank, 3, 20)
        out[rank] = sorted(conns)
        for conn in conns.values():
            conn.close()

    zero = threading.Thread(target=process, args=(0,), daemon=True)
    zero.start()
    gone = net.connect("127.0.0.1", port, 5.0)
    net.send(gone, {"rank": 1, "world": 3})       # rank 1 reports, then dies
    time.sleep(0.3)
    gone.close()
    others = [threading.Thread(target=process, args=(r,), daemon=True) for r in (1, 2)]
    for t in others:
        t.start()
    for t in (zero, *others):
        t.join(30)
    assert out == {0: [1, 2], 1: [0], 2: [0]}


@pytest.mark.parametrize("env, words", [
    ({"LOCAL_WORLD_SIZE": "4"}, ["LOCAL_WORLD_SIZE=4 is set but RANK and WORLD_SIZE are not",
                                 "left over", "--nproc_per_node 4"]),
    ({"LOCAL_WORLD_SIZE": "2", "SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1",
      "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, ["LOCAL_WORLD_SIZE=2 is set", "left over"]),
    ({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
      "MASTER_PORT": "1"}, ["LOCAL_WORLD_SIZE=4 is above WORLD_SIZE=2"]),
])
def test_a_leftover_or_inconsistent_local_world_size_is_named(env, words):
    from jdp.distributed import _init
    one_line_error(ValueError, words, _init._plan, None, None, None, None, None, env)


def test_local_world_size_with_the_launchers_other_variables_is_taken():
    from jdp.distributed import _init
    env = {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    assert _init._plan(None, None, None, None, None, env)[:4] == ("127.0.0.1:1", 4, 3, [1])


def test_a_second_process_0_is_named_on_both():
    from conftest import free_port

    from jdp.distributed import _rendezvous
    port, done = free_port(), {}
    first = threading.Thread(target=lambda: done.update(
        zero=_outcome(_rendezvous.gather, "127.0.0.1", port, 2, 20)), daemon=True)
    first.start()
    time.sleep(0.5)                                    # the first process 0 listens
    second = _outcome(_rendezvous.second_zero, "127.0.0.1", port, 2)
    first.join(10)
    for error in (second, done["zero"]):
        assert isinstance(error, ValueError), (second, done)
        assert_one_line(error, ["two processes were started with RANK=0"])


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the outcome under test
        return e


ALLOCATION = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2",
              "SLURM_NODELIST": "n[1-2]"}


@pytest.mark.parametrize("env", [
    ALLOCATION,                                                     # salloc's shell
    {**ALLOCATION, "SLURM_STEP_ID": str(2**32 - 5), "SLURM_PROCID": "0",
     "SLURM_STEP_NODELIST": "n1"},                                  # sbatch's script (batch step)
])
def test_python_inside_a_slurm_allocation_without_srun_is_warned(env):
    from jdp.distributed import _init
    with pytest.warns(UserWarning) as caught:
        assert _init._plan(None, None, None, None, None, env) is None
    (warning,) = caught
    assert_one_line(warning.message, ["SLURM job 42", "8 task(s) on 2 node(s)", "not started by "
                                      "srun", "come from the allocation", "srun python"])


@pytest.mark.parametrize("env", [
    {**ALLOCATION, "SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "1"},   # one task: alone is right
    {**ALLOCATION, "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "n1",
     "SLURM_NTASKS": "1"},                                             # srun -n 1
    {**ALLOCATION, "WORLD_SIZE": "1", "RANK": "0"},                    # jdp.launch in sbatch
])
def test_a_slurm_step_or_a_one_task_allocation_is_not_warned(env):
    import warnings

    from jdp.distributed import _init
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _init._plan(None, None, None, None, None, env) is None


def test_an_srun_step_is_still_found_but_not_the_batch_step():
    from jdp.distributed import _engines
    step = {**ALLOCATION, "SLURM_STEP_ID": "3", "SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "n1"}
    assert _engines.slurm(step).cluster == "slurm"
    assert _engines.slurm({**step, "SLURM_STEP_ID": str(2**32 - 5)}) is None


def test_the_launchers_device_count_replaced_by_the_script_is_warned():
    from jdp.distributed import _init
    from jdp.launch import _supervisor
    env = _supervisor.rank_env({"XLA_FLAGS": "--xla_cpu_use_thunk_runtime=true"}, rank=0,
                               local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                               master_addr="127.0.0.1", master_port=1, devices_per_process=2)
    assert _init._devices_flag_replaced(env) is None          # as the launcher set it
    for flags, now in [("--xla_force_host_platform_device_count=4", "count=4"),
                       ("--xla_dump_to=/tmp/x", "no --xla_force_host_platform_device_count")]:
        warning = _init._devices_flag_replaced({**env, "XLA_FLAGS": flags})
        assert_one_line(warning, ["--devices_per_process 2 is overridden", now,
                                  "os.environ['XLA_FLAGS'] +="])
    assert _init._devices_flag_replaced({"XLA_FLAGS": "--xla_dump_to=/tmp/x"}) is None


REPLACES_XLA_FLAGS = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=3"
import jax, jdp
jdp.initialize()
print("devices", jax.local_device_count())
"""


def test_a_launched_script_that_replaces_xla_flags_is_warned(tmp_path):
    from conftest import run_python, write_script
    script = write_script(tmp_path, "flags.py", REPLACES_XLA_FLAGS)
    done = run_python(["-m", "jdp.launch", "--nproc_per_node", "1", "--devices_per_process", "2",
                       script], timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "devices 3" in done.stdout                           # what the warning says happened
    assert "--devices_per_process 2 is overridden" in done.stderr, done.stderr[-2000:]


# --- --profile_steps / JDP_PROFILE_STEPS: a range that traced nothing, said ------------------

OWN_STEP = """
import jax, numpy as np, jdp
jdp.initialize()
loader = jdp.data.Loader({"x": np.ones((32, 4), np.float32)}, batch_size=8)
own = jax.jit(lambda batch: (batch["x"] * 2).sum())
for batch in loader:
    own(batch).block_until_ready()
"""


def test_a_profile_range_over_an_own_step_is_said_at_the_end(tmp_path):
    from conftest import job_env, run_python, write_script
    script = write_script(tmp_path, "own.py", OWN_STEP)
    logs = tmp_path / "logs"
    done = run_python(["-m", "jdp.launch", "--logdir", str(logs), "--profile_steps", "2:3",
                       script], env=job_env("profile-own"), timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert_one_line(line, ["jdp.launch: --profile_steps 2:3 produced no trace",
                           str(logs / "profile"), "counted 4 training step(s)",
                           "only jdp.train_step's steps are traced"])


def test_a_profile_range_past_the_end_is_named(tmp_path, monkeypatch):
    from jdp.launch import _profile_opts
    monkeypatch.delenv("JDP_PROFILE_STEPS", raising=False)
    monkeypatch.delenv("JDP_PROFILE_DIR", raising=False)
    assert_one_line(_profile_opts.no_trace("50:60", str(tmp_path), 5),
                    ["--profile_steps 50:60 produced no trace", "ran 5 training step(s)",
                     "ended before step 50"])
    assert _profile_opts.no_trace(None, str(tmp_path), 5) is None   # nothing asked
    rank = tmp_path / "profile" / "rank.0" / "plugins" / "profile" / "t"
    rank.mkdir(parents=True)
    (rank / "host.xplane.pb").write_bytes(b"x")
    assert _profile_opts.no_trace("50:60", str(tmp_path), 5) is None   # a trace was written


def test_jdp_profile_steps_without_a_directory_is_named_by_the_launcher(tmp_path, monkeypatch):
    from jdp.launch import _profile_opts
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JDP_PROFILE_STEPS", "3:4")
    monkeypatch.delenv("JDP_PROFILE_DIR", raising=False)
    assert_one_line(_profile_opts.no_directory(None, None),
                    ["JDP_PROFILE_STEPS='3:4' is set without JDP_PROFILE_DIR",
                     f"{tmp_path / 'profile'}/rank.K", "--logdir DIR"])
    assert_one_line(_profile_opts.no_trace(None, None, 0),
                    ["JDP_PROFILE_STEPS=3:4 produced no trace", str(tmp_path / "profile")])
    assert _profile_opts.no_directory(None, str(tmp_path)) is None   # LOGDIR/profile
    monkeypatch.setenv("JDP_PROFILE_DIR", str(tmp_path / "mine"))
    assert _profile_opts.no_directory(None, None) is None
    assert str(tmp_path / "mine") in _profile_opts.no_trace(None, None, 0)
