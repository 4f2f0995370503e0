"""`--profile_steps A:B`: a jax.profiler trace of training steps A..B on every rank."""
import glob
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, job_env, write_script

from jdp.job import rank as _rank
from jdp.metrics import profile as _profile

# Five jdp train steps on each of 2 ranks.
JOB = """
import jax, jax.numpy as jnp, numpy as np, optax
import jdp

jdp.initialize()
state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params={"w": jnp.zeros((16, 16))},
                                            tx=optax.sgd(0.01)))
step = jdp.train_step(lambda p, b: jnp.mean((b["x"] @ p["w"] - 1.0) ** 2))
for _ in range(5):
    state, metrics = step(state, jdp.shard({"x": np.ones((4, 16), np.float32)}))
jax.block_until_ready(state)
"""


def launch(tmp_path, *options):
    script = write_script(tmp_path, "job.py", JOB)
    return subprocess.run([sys.executable, "-m", "jdp.launch", "--nproc_per_node", "2",
                           *options, script], env=job_env("profile"), cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def traced_steps(xplane: str) -> list:
    """The step numbers of the "train" step annotations in a trace file."""
    from jax.profiler import ProfileData
    return sorted(dict(e.stats)["step_num"] for plane in ProfileData.from_file(xplane).planes
                  for line in plane.lines for e in line.events if e.name == "train")


def test_profile_steps_under_the_launcher_trace_those_steps_on_every_rank(tmp_path):
    logs = tmp_path / "logs"
    done = launch(tmp_path, "--logdir", str(logs), "--profile_steps", "2:3")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((logs / "summary.json").read_text())
    for rank in (0, 1):
        found = glob.glob(f"{logs}/profile/rank.{rank}/plugins/profile/*/*.xplane.pb")
        assert len(found) == 1, os.listdir(logs / "profile")
        assert traced_steps(found[0]) == [2, 3]
        perfetto = os.path.join(os.path.dirname(found[0]), "perfetto_trace.json.gz")
        assert os.path.getsize(perfetto) > 0
        assert {found[0], perfetto} <= set(summary["profiles"])
    assert f"profiles of 2 ranks in {logs / 'profile'}" in done.stderr


@pytest.mark.parametrize("options, expected", [
    (["--logdir", "LOGS", "--profile_steps", "5:3"], "--profile_steps 5:3: must be A:B"),
    (["--logdir", "LOGS", "--profile_steps", "0:2"], "1 <= A <= B"),
    (["--profile_steps", "2:3"], "needs --logdir DIR"),
])
def test_a_bad_profile_range_is_a_one_line_error(tmp_path, options, expected):
    options = [str(tmp_path / "logs") if o == "LOGS" else o for o in options]
    done = launch(tmp_path, *options)
    assert done.returncode == 2
    message = done.stderr.strip().splitlines()[-1]
    assert expected in message, done.stderr
    assert not os.path.exists(tmp_path / "logs" / "profile")


def test_spawn_traces_the_steps_asked_for_on_every_rank(tmp_path, monkeypatch):
    import _profile_targets as targets

    import jdp
    for key, value in job_env("profile-spawn").items():
        monkeypatch.setenv(key, value)
    jdp.spawn(targets.train, args=(4,), nprocs=2, logdir=str(tmp_path), profile_steps="3:4")
    for rank in (0, 1):
        found = glob.glob(f"{tmp_path}/profile/rank.{rank}/plugins/profile/*/*.xplane.pb")
        assert len(found) == 1 and traced_steps(found[0]) == [3, 4]


def test_spawn_refuses_a_profile_without_logdir_before_starting():
    from jdp.launch import spawn
    with pytest.raises(ValueError, match="profile_steps='1:2' needs logdir=DIR"):
        spawn(print, nprocs=2, profile_steps="1:2")


def test_the_environment_asks_ranks_under_srun_or_mpirun():
    assert _profile.window_from_env({}) is None
    window = _profile.window_from_env({_profile.STEPS: "4:6", _profile.DIR: "/tmp/x"})
    assert window == _profile.Window(4, 6, "/tmp/x")
    assert _profile.window_from_env({_profile.STEPS: "7:7"}).directory == "profile"
    with pytest.raises(ValueError, match="JDP_PROFILE_STEPS='6:4' must be A:B"):
        _profile.window_from_env({_profile.STEPS: "6:4"})


def test_the_layouts_breakdown_splits_each_step_into_parts_that_add_up():
    """Two ranks, one step: rank 0 arrives first and waits 3 ms in an all-reduce of 5 ms;
    rank 1's all-reduce (2 ms) is the transfer itself."""
    from benchmarks import layouts
    ranks = [[{"wall": 20.0, "compute": 12.0, "all_reduce": 5.0}],
             [{"wall": 20.0, "compute": 15.0, "all_reduce": 2.0}]]
    parts = layouts.breakdown(ranks)
    expected = {"compute": 13.5, "collective": 2.0, "wait": 1.5, "host": 3.0, "wall": 20.0}
    assert parts == pytest.approx(expected)
    assert layouts._union([(0, 4), (2, 6), (8, 9)]) == 7


def test_the_layouts_step_figures_read_a_real_trace(tmp_path):
    """Three annotated steps of a jitted function: three steps, each with XLA ops inside."""
    import jax
    import jax.numpy as jnp

    from benchmarks import layouts
    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((64, 64))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for k in range(3):
            with jax.profiler.StepTraceAnnotation("train", step_num=k):
                f(x).block_until_ready()
    steps = layouts.step_figures(glob.glob(f"{tmp_path}/**/*.xplane.pb", recursive=True)[0])
    assert len(steps) == 3
    for s in steps:
        assert 0 < s["compute"] <= s["wall"] and s["all_reduce"] == 0


def test_a_trace_the_user_runs_already_is_left_alone(tmp_path, monkeypatch):
    """jax allows one trace at a time: the user's keeps running, jdp warns and steps on."""
    import jax
    state = _rank.current().profile
    monkeypatch.setattr(state, "window", _profile.Window(1, 2, str(tmp_path / "jdp")))
    monkeypatch.setattr(state, "read", True)
    with jax.profiler.trace(str(tmp_path / "mine")):
        with pytest.warns(UserWarning, match="Not tracing"):
            assert _profile.before_step(1) is None
        assert _profile.before_step(2) is None
    assert not state.tracing and not os.path.exists(tmp_path / "jdp")
    assert glob.glob(f"{tmp_path}/mine/**/*.xplane.pb", recursive=True)


def test_the_launcher_sends_ranks_the_steps_and_logdir_profile(monkeypatch):
    """The option sets both variables; the variable alone gets LOGDIR/profile as its
    directory unless JDP_PROFILE_DIR names one; nothing without a range."""
    # private: the internals this test checks have no public name
    from jdp.launch import _profile_opts
    monkeypatch.delenv(_profile.STEPS, raising=False)
    monkeypatch.delenv(_profile.DIR, raising=False)
    where = os.path.abspath("/x/profile")
    assert _profile_opts.rank_env("4:5", "/x") == {_profile.STEPS: "4:5", _profile.DIR: where}
    assert _profile_opts.rank_env(None, "/x") == {}
    monkeypatch.setenv(_profile.STEPS, "2:3")
    assert _profile_opts.rank_env(None, "/x") == {_profile.DIR: where}
    assert _profile_opts.rank_env(None, None) == {}
    monkeypatch.setenv(_profile.DIR, "/elsewhere")
    assert _profile_opts.rank_env(None, "/x") == {}
