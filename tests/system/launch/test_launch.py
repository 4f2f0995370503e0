"""`python -m jdp.launch`: real processes on 127.0.0.1 forming one JAX job, and fail-fast.

Every job is tagged (JDP_TEST_TAG) so each test can check that none of its processes remain.
Times asserted here are generous upper bounds (the machines are shared); the measured ones
are printed.
"""
import json
import signal
import socket
import subprocess
import time

import pytest
from conftest import (
    RANK_1_LEAVES,
    free_port,
    job_env,
    start_launcher,
    wait_for_text,
    wait_until_gone,
    write_script,
)

import jdp.launch

TIMEOUT = 120

# Rank r holds values r*10 + 0..n-1 on its n devices; every rank prints what it saw.
JOB = """
import json, os
import jax, numpy as np
import jdp

jdp.initialize()
jdp.initialize()                                   # a second identical call is a no-op
r, n = jax.process_index(), jax.local_device_count()
values = np.arange(n, dtype=np.float32) + 10.0 * r
mean = jax.pmap(lambda v: jax.lax.pmean(v, "i"), axis_name="i")(values)
res = {"rank": r, "env": {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
       "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "JDP_RESTART_COUNT")},
       "count": jdp.process_count(), "index": jdp.process_index(), "primary": jdp.is_primary(),
       "devices": jax.device_count(), "mean": float(mean[0])}
try:
    jdp.initialize(process_id=(r + 1) % jax.process_count())   # a different job
    res["different"] = "no error"
except RuntimeError as e:
    res["different"] = str(e)
jdp.barrier("after-mean", timeout_s=30)
res["broadcast"] = jdp.broadcast_from_primary({"w": np.full(3, float(r))})["w"].tolist()
try:
    res["replicate"] = np.asarray(jdp.replicate({"w": np.full(3, float(r))})["w"]).tolist()
except Exception as e:                             # state.py may not be there yet
    res["replicate"] = repr(e)
jdp.print0("PRINT0 once")
print("RESULT " + json.dumps(res), flush=True)
jdp.shutdown()
jdp.shutdown()                                     # safe twice
"""


def results(stdout: str) -> dict:
    """rank -> the RESULT dict that rank printed (lines look like `[rankK]: RESULT {...}`)."""
    found = {}
    for line in stdout.splitlines():
        if "RESULT " in line:
            res = json.loads(line.split("RESULT ", 1)[1])
            assert line.startswith(f"[rank{res['rank']}]: ")
            found[res["rank"]] = res
    return found


def expected_mean(processes: int, devices: int) -> float:
    """The arithmetic mean of all values the job's devices hold, computed independently."""
    values = [10.0 * r + d for r in range(processes) for d in range(devices)]
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-process job (1 device each), shared by the tests that read its output."""
    import uuid
    tag = uuid.uuid4().hex
    script = write_script(tmp_path_factory.mktemp("job"), "job.py", JOB)
    proc = start_launcher(["--nproc_per_node", 2, script], job_env(tag))
    out, err = proc.communicate(timeout=TIMEOUT)
    wait_until_gone(tag, timeout=5.0)
    return proc.returncode, out, err


def test_two_ranks_agree_on_the_global_mean(two_ranks):
    code, out, err = two_ranks
    assert code == 0, err
    res = results(out)
    assert sorted(res) == [0, 1]
    for r in res.values():
        assert r["count"] == 2 and r["index"] == r["rank"] and r["primary"] == (r["rank"] == 0)
        assert r["mean"] == pytest.approx(expected_mean(2, 1))


def test_each_rank_gets_the_torchrun_environment(two_ranks):
    res = results(two_ranks[1])
    port = res[0]["env"]["MASTER_PORT"]
    assert port.isdigit()
    for rank, r in res.items():
        assert r["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                            "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": port, "JDP_RESTART_COUNT": "0"}


def test_initialize_again_for_another_job_raises(two_ranks):
    for r in results(two_ranks[1]).values():
        assert "already called" in r["different"]


def test_broadcast_and_replicate_give_process_0s_values(two_ranks):
    for r in results(two_ranks[1]).values():
        assert r["broadcast"] == [0.0, 0.0, 0.0]
        assert r["replicate"] == [[0.0, 0.0, 0.0]], r["replicate"]


def test_print0_prints_once_per_job(two_ranks):
    assert two_ranks[1].count("PRINT0 once") == 1
    assert "[rank0]: PRINT0 once" in two_ranks[1]


def test_devices_per_process_and_logdir_files(tmp_path, tag):
    """2 processes x 2 simulated devices = 4 devices; output only in DIR/rank.K/stdout."""
    script = write_script(tmp_path, "job.py", JOB)
    logdir = tmp_path / "logs"
    proc = start_launcher(["--nproc_per_node", 2, "--devices_per_process", 2, "--logdir", logdir,
                           "--redirect_stdout_and_stderr", script], job_env(tag))
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert "RESULT" not in out
    for rank in (0, 1):
        text = (logdir / f"rank.{rank}" / "stdout").read_text()
        res = json.JSONDecoder().raw_decode(text.split("RESULT ", 1)[1])[0]  # stderr may follow
        assert res["devices"] == 4 and res["count"] == 2
        assert res["mean"] == pytest.approx(expected_mean(2, 2))
        assert (logdir / f"rank.{rank}" / "stderr").exists()


def test_two_launchers_form_one_four_process_job(tmp_path, tag):
    """--nnodes 2 on one machine: node 0 and node 1 each start 2 ranks of one job."""
    script = write_script(tmp_path, "job.py", JOB)
    port = free_port()
    nodes = [start_launcher(["--nnodes", 2, "--node_rank", node, "--nproc_per_node", 2,
                             "--master_port", port, "--logdir", tmp_path / "logs", script],
                            job_env(tag)) for node in (1, 0)]
    outs = [p.communicate(timeout=TIMEOUT) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    res = {**results(outs[0][0]), **results(outs[1][0])}
    assert sorted(res) == [0, 1, 2, 3]
    for rank, r in res.items():
        assert r["count"] == 4 and r["env"]["NODE_RANK"] == str(rank // 2)
        assert r["env"]["LOCAL_RANK"] == str(rank % 2)
        assert r["mean"] == pytest.approx(expected_mean(4, 1))
    # --logdir without --redirect_stdout_and_stderr: in the files and on the console.
    assert "RESULT" in (tmp_path / "logs" / "rank.3" / "stdout").read_text()


@pytest.mark.parametrize("mode, code, text", [("exit", 3, "exit code 3"),
                                              ("raise", 1, "RuntimeError: boom from rank 1")])
def test_a_failing_rank_stops_the_job_with_its_exit_code(tmp_path, tag, mode, code, text):
    script = write_script(tmp_path, "fail.py", RANK_1_LEAVES)
    proc = start_launcher(["--nproc_per_node", 2, script], job_env(tag, MODE=mode))
    out, err = proc.communicate(timeout=TIMEOUT)
    ended = time.time()
    left = float(err.split("LEAVING ", 1)[1].split()[0])
    print(f"{mode}: launcher exited {ended - left:.2f} s after rank 1 left")
    assert proc.returncode == code, err
    assert ended - left < 10
    summary = err[err.index("jdp.launch: rank"):]
    assert f"jdp.launch: rank 1 of 2 failed with exit code {code}" in summary
    assert text in summary and "LEAVING" in summary    # the tail of rank 1's stderr
    assert wait_until_gone(tag, timeout=1.0) < 1.0


SLEEPER = """
import time
import jax
import jdp

jdp.initialize()
print("ready", jax.process_index(), flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_the_launcher_stops_every_rank(tmp_path, tag, sig):
    """SIGTERM is forwarded (exit 128+15); after SIGKILL the ranks die with it (PDEATHSIG)."""
    script = write_script(tmp_path, "sleeper.py", SLEEPER)
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        # A SIGKILLed launcher cannot remove a temporary compilation cache: choose one here.
        env = job_env(tag, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
        proc = start_launcher(["--nproc_per_node", 2, script], env, stdout=f,
                              stderr=subprocess.STDOUT)
        wait_for_text(out, "ready", 2, timeout=TIMEOUT)
        start = time.monotonic()
        proc.send_signal(sig)
        wait_until_gone(tag, timeout=5.0)
        gone = time.monotonic() - start
        print(f"{sig.name}: every rank gone {gone:.2f} s after the signal")
        assert proc.wait(timeout=10) == (128 + sig if sig == signal.SIGTERM else -sig)
    assert gone < 5.0


RESTART = """
import os, sys
import jdp

jdp.initialize()
if os.environ["JDP_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    sys.exit(5)
print("attempt", os.environ["JDP_RESTART_COUNT"], "done", flush=True)
"""


def test_max_restarts_restarts_all_ranks_after_a_failure(tmp_path, tag):
    script = write_script(tmp_path, "restart.py", RESTART)
    proc = start_launcher(["--nproc_per_node", 2, "--max_restarts", 1, script], job_env(tag))
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert "rank 1 of 2 failed with exit code 5" in err and "restart 1 of 1" in err
    assert "[rank0]: attempt 1 done" in out and "[rank1]: attempt 1 done" in out


def test_no_python_children_see_their_rank_variables(tag):
    proc = start_launcher(["--nproc_per_node", 2, "--master_port", free_port(), "--no_python",
                           "sh", "-c", "echo $RANK/$LOCAL_RANK/$WORLD_SIZE/$LOCAL_WORLD_SIZE"],
                          job_env(tag))
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert sorted(out.splitlines()) == ["[rank0]: 0/0/2/2", "[rank1]: 1/1/2/2"]


def test_module_mode_runs_a_module_as_main(tag):
    proc = start_launcher(["-m", "json.tool", "--help"], job_env(tag))
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert out.startswith("[rank0]: usage:") and "json.tool" in out


def test_missing_script_fails_before_anything_starts(tmp_path, tag):
    proc = start_launcher(["--nproc_per_node", 2, tmp_path / "nope.py"], job_env(tag))
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 2
    assert "nope.py' does not exist" in err.splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["--nproc_per_node", "0", "x.py"], "--nproc_per_node 0: must be an int >= 1"),
    (["--nnodes", "2", "--node_rank", "2", "--master_port", "1234", "x.py"],
     "--node_rank 2 is not in 0..1"),
    (["--nnodes", "2", "x.py"], "--master_port is required with --nnodes 2"),
    (["--redirect_stdout_and_stderr", "x.py"], "needs --logdir"),
])
def test_bad_arguments_exit_2_with_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        jdp.launch.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_master_port_in_use_is_refused(tmp_path, capsys):
    script = write_script(tmp_path, "ok.py", "print('never runs')\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            jdp.launch.main(["--master_port", str(port), script])
    assert exit_info.value.code == 2
    assert f"--master_port={port} is already in use" in capsys.readouterr().err


def test_help_documents_every_option_and_variable():
    # private: the internals this test checks have no public name
    from jdp.launch._cli import build_parser
    text = build_parser().format_help()
    for word in ("--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port",
                 "--logdir", "--redirect_stdout_and_stderr", "--no_python", "--max_restarts",
                 "--devices_per_process", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                 "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "JDP_RESTART_COUNT"):
        assert word in text


def test_children_get_the_allocator_settings_unless_turned_off():
    from jdp.job import malloc as _malloc

    # private: the internals this test checks have no public name
    from jdp.launch import _supervisor

    def env_of(base):
        return _supervisor.rank_env(base, rank=0, local_rank=0, world_size=1,
                                    local_world_size=1, node_rank=0, master_addr="127.0.0.1",
                                    master_port=1234)

    assert {k: env_of({})[k] for k in _malloc.ENV} == {
        "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_ARENA_MAX": "1"}
    assert env_of({"MALLOC_ARENA_MAX": "4"})["MALLOC_ARENA_MAX"] == "4"   # the user's choice wins
    assert not set(_malloc.ENV) & set(env_of({"JDP_MALLOC_TUNING": "0"}))


def test_gloo_connection_lines_stay_off_the_console(two_ranks):
    """gloo prints one '[Gloo] Rank N is connected to M peer ranks' line per rank: log only."""
    code, out, err = two_ranks
    assert code == 0
    assert "[Gloo]" not in out and "[Gloo]" not in err, err


def test_gloo_connection_lines_are_kept_in_the_log_files(tmp_path, tag):
    script = write_script(tmp_path, "job.py", JOB)
    logdir = tmp_path / "logs"
    proc = start_launcher(["--nproc_per_node", 2, "--logdir", logdir, script], job_env(tag))
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert "[Gloo]" not in out + err
    logged = "".join((logdir / f"rank.{r}" / s).read_text() for r in (0, 1)
                     for s in ("stdout", "stderr"))
    assert logged.count("[Gloo] Rank") == 2, logged


def _module_level_imports(tree):
    """Top-level names a module imports when it is loaded (imports inside functions run later,
    in a rank, and are not the launcher's)."""
    import ast
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module if node.level == 0 else "."
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]


def test_the_launcher_imports_the_standard_library_only():
    """No module of jdp/launch or of the job's contract (jdp/job) loads JAX, numpy or any other
    package: the launcher process stays light; jdp/job imports nothing of jdp but itself, and
    the runner (run.py, run by path before the user's script) imports no jdp module at all."""
    import ast
    import pathlib
    import sys
    job = pathlib.Path(jdp.launch.__file__).parent.parent / "job"
    for path in sorted([*pathlib.Path(jdp.launch.__file__).parent.glob("*.py"),
                        *job.glob("*.py")]):
        floors = ("jdp.job",) if path.parent == job else ("jdp.job", "jdp.launch")
        for name in _module_level_imports(ast.parse(path.read_text())):
            top = name.split(".")[0]
            allowed = top in sys.stdlib_module_names or (path.name != "run.py" and any(
                name == floor or name.startswith(floor + ".") for floor in floors))
            assert allowed, f"{path.parent.name}/{path.name} imports {name}"


def test_each_way_a_round_ends_has_one_exit_status():
    from jdp.job.outcome import Outcome, RankExit, Stall, State, Stop, exit_status
    assert exit_status(Outcome(State.SUCCEEDED)) == 0
    assert exit_status(Outcome(State.FAILED, 1.0, RankExit(1, 3, ()))) == 3
    assert exit_status(Outcome(State.FAILED, 1.0, RankExit(1, -signal.SIGKILL, ()))) == 137
    assert exit_status(Outcome(State.STALLED, 1.0, Stall([], {}))) == 124
    assert exit_status(Outcome(State.SIGNALED, 1.0, Stop(signal.SIGTERM, 30.0, (), ()))) == 143


def test_rounds_restart_after_a_failure_and_report_it_once(capsys):
    """The round protocol without processes: round 0 fails, round 1 (the restart) succeeds."""
    from jdp.job.outcome import Job, Outcome, RankExit, State

    # private: the internals this test checks have no public name
    from jdp.launch import _rounds
    rounds = []

    def run_round(r, stop):
        rounds.append(r)
        if r == 0:
            return Outcome(State.FAILED, 0.5, RankExit(1, 5, ("boom",)))
        return Outcome(State.SUCCEEDED, 0.5)

    assert _rounds.run(Job("jdp.launch", 2), 1, None, run_round) == 0
    assert rounds == [0, 1]
    err = capsys.readouterr().err
    assert err.count("jdp.launch: rank 1 of 2 failed with exit code 5 after 0.5 s") == 1, err
    assert "  boom" in err and "restart 1 of 1" in err


def test_without_restarts_left_the_job_exits_with_the_failed_rank_s_status(capsys):
    from jdp.job.outcome import Job, Outcome, RankExit, State

    # private: the internals this test checks have no public name
    from jdp.launch import _rounds

    def run_round(r, stop):
        return Outcome(State.FAILED, 0.1, RankExit(0, -signal.SIGKILL, ()))

    assert _rounds.run(Job("jdp.launch", 1), 0, None, run_round) == 137
    assert "rank 0 of 1 failed with signal SIGKILL (exit status 137)" in capsys.readouterr().err
