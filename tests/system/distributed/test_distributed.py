"""`jdp.initialize` and the process helpers: where settings come from, and bad input.

The multi-process happy path runs under the launcher (test_launch.py); here are the single
process no-op, the precedence of arguments over the environment, the one-line errors, and a
2-process job started by hand (no launcher) in which a rank raises.
"""
import logging
import os
import socket
import subprocess
import sys
import time

import jax
import pytest
from conftest import REPO, free_port, job_env, run_python, write_script

import jdp

# private: the internals this test checks have no public name
from jdp.distributed import _init as distributed

# private: the internals this test checks have no public name
from jdp.distributed import _log

LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
               "LOCAL_WORLD_SIZE", "NODE_RANK", "JAX_LOCAL_DEVICE_IDS", "JDP_CLUSTER_DETECTION",
               "SLURM_JOB_ID", "SLURM_NTASKS", "OMPI_MCA_orte_hnp_uri", "JDP_INIT_TIMEOUT")


@pytest.fixture
def env(monkeypatch):
    """A clean launcher environment; set variables with env(NAME=value)."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)

    def set_vars(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))
    return set_vars


def test_a_plain_single_process_is_a_quiet_no_op(env):
    jdp.initialize()
    jdp.initialize()
    assert not jax.distributed.is_initialized()
    assert jdp.process_count() == 1 and jdp.process_index() == 0 and jdp.is_primary()


def test_world_size_1_is_a_no_op(env):
    env(WORLD_SIZE=1, RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=1)
    jdp.initialize()
    assert not jax.distributed.is_initialized()


def test_single_process_helpers_work_without_a_job(env, capsys):
    jdp.barrier("nothing-to-wait-for", timeout_s=1)
    jdp.print0("hello from 0")
    jdp.shutdown()
    jdp.shutdown()
    assert capsys.readouterr().out == "hello from 0\n"


def test_print0_and_get_logger_speak_on_rank_0_only(env, capsys):
    env(RANK=1)                   # the rank a launched process has before initialize()
    log = jdp.get_logger("jdp.test.rank1")
    jdp.print0("not printed")
    log.info("not logged")
    log.warning("warnings come from every rank")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "[rank1] WARNING jdp.test.rank1: warnings come from every rank" in captured.err
    assert "not logged" not in captured.err


def test_explicit_arguments_win_over_the_environment(env):
    env(MASTER_ADDR="10.0.0.1", MASTER_PORT=1234, WORLD_SIZE=4, RANK=3, LOCAL_RANK=1,
        LOCAL_WORLD_SIZE=2)
    from_env = distributed._plan(None, None, None, None, None, dict(os.environ))
    assert from_env[:5] == ("10.0.0.1:1234", 4, 3, [1], None)
    explicit = distributed._plan("127.0.0.1:999", 2, 0, [0], None,
                                 dict(os.environ))
    assert explicit[:5] == ("127.0.0.1:999", 2, 0, [0], None)


def test_cluster_detection_only_when_a_cluster_launched_several_tasks():
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "0"}
    assert distributed._detect_cluster(None, {**slurm, "SLURM_NTASKS": "1"}) is None
    assert distributed._detect_cluster(None, {**slurm, "SLURM_NTASKS": "4"}) == "slurm"
    assert distributed._detect_cluster(None, {"JDP_CLUSTER_DETECTION": "mpi4py"}) == "mpi4py"
    assert distributed._detect_cluster(None, {}) is None


@pytest.mark.parametrize("variables, message", [
    ({"WORLD_SIZE": 2, "RANK": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1},
     "RANK / process_id=2 is outside 0..1"),
    ({"WORLD_SIZE": 2, "RANK": 0, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"},
     "MASTER_PORT='http' is not an integer"),
    ({"WORLD_SIZE": 2, "RANK": 0}, "needs MASTER_ADDR and MASTER_PORT"),
    ({"WORLD_SIZE": "two", "RANK": 0}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": 2, "RANK": 1, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1, "LOCAL_RANK": 2,
      "LOCAL_WORLD_SIZE": 2}, "LOCAL_RANK=2 is outside 0..1"),
    ({"JDP_INIT_TIMEOUT": "soon"}, "JDP_INIT_TIMEOUT='soon' must be a whole number"),
])
def test_bad_settings_raise_one_line_value_errors(env, variables, message):
    env(**variables)
    with pytest.raises(ValueError, match=message) as info:
        jdp.initialize()
    assert "\n" not in str(info.value)
    assert not jax.distributed.is_initialized()


TRY_INIT = """
import time, jdp
start = time.monotonic()
try:
    jdp.initialize()
except (ValueError, TimeoutError) as e:
    print(f"{type(e).__name__} after {time.monotonic() - start:.2f} s: {e}")
"""


def test_coordinator_port_in_use_on_process_0_raises(tmp_path):
    script = write_script(tmp_path, "init.py", TRY_INIT)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_python([script], env=job_env("port-in-use", WORLD_SIZE="2", RANK="0",
                                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    assert done.returncode == 0, done.stderr      # JAX itself would die with SIGSEGV
    assert "ValueError after" in done.stdout
    assert f"MASTER_PORT={port} is already in use" in done.stdout
    # the port is re-tried for 2 s, and its holder asked for 2 s whether it is a process 0
    # too: a listener that never answers is not asked again until its backlog fills (20 s)
    assert float(done.stdout.split("ValueError after ")[1].split(" s")[0]) < 10, done.stdout


def test_a_port_held_for_a_moment_counts_as_free_once_let_go():
    """An outgoing connection may hold a port as its source for a moment; the port check
    tries again for `settle_s` before calling the port busy, and a port held longer is busy."""
    import threading

    from jdp.job import net
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    threading.Timer(0.5, busy.close).start()
    assert "already in use" in net.port_problem("127.0.0.1", port, settle_s=0)
    start = time.monotonic()
    assert net.port_problem("127.0.0.1", port, settle_s=5) is None
    assert 0.3 < time.monotonic() - start < 5


def test_unreachable_coordinator_raises_within_the_init_timeout(tmp_path):
    script = write_script(tmp_path, "init.py", TRY_INIT)
    done = run_python([script], env=job_env("unreachable", WORLD_SIZE="2", RANK="1",
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                                            JDP_INIT_TIMEOUT="2"))
    assert done.returncode == 0, done.stderr      # JAX itself would abort (SIGABRT)
    assert "TimeoutError after" in done.stdout
    assert "could not reach the coordinator" in done.stdout
    waited = float(done.stdout.split("after ", 1)[1].split(" s", 1)[0])
    print(f"unreachable coordinator: TimeoutError after {waited:.2f} s (timeout 2 s)")
    assert 1.5 < waited < 2 + 10   # not JAX's own minutes; a loaded machine adds seconds


RAISING_RANK = """
import os, sys, time
import jax, numpy as np
import jdp

jdp.initialize()
if jax.process_index() == 1:
    raise RuntimeError("rank 1 gives up")
time.sleep(60)
"""


def test_without_the_launcher_a_raising_rank_still_exits_at_once(tmp_path, tag):
    """The excepthook: code 1 and the traceback, not a wait in JAX's shutdown barrier."""
    script = write_script(tmp_path, "raising.py", RAISING_RANK)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, script], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=job_env(tag, WORLD_SIZE="2", RANK=str(r), MASTER_ADDR="127.0.0.1",
                                          MASTER_PORT=port))
             for r in (0, 1)]
    try:
        start = time.monotonic()
        _, err = procs[1].communicate(timeout=60)
        print(f"raising rank exited {time.monotonic() - start:.2f} s after start")
        assert procs[1].returncode == 1
        assert "RuntimeError: rank 1 gives up" in err
    finally:
        for p in procs:
            p.kill()
            p.communicate(timeout=10)


def test_get_logger_is_safe_before_initialize_and_idempotent():
    a = jdp.get_logger("jdp.test.same")
    b = jdp.get_logger("jdp.test.same", level=logging.WARNING)
    assert a is b and len(a.handlers) == 1 and a.level == logging.WARNING
    assert len([f for f in a.filters if isinstance(f, _log._RankFilter)]) == 1
