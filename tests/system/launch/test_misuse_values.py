"""Every value a user gives the launcher, or jdp through the environment, is parsed at start:
finite, in range, ports distinct, JDP_* variables valid, or a one-line error naming the value
(never a wait that cannot end, nor a feature silently off)."""
import subprocess

import pytest
from conftest import (
    MPIRUN,
    REPO,
    assert_one_line,
    free_port,
    job_env,
    launch_fails,
    mpirun_command,
    write_script,
)

import jdp
import jdp.launch


@pytest.mark.parametrize("argv, message", [
    # node 0's round keeper died of OverflowError on inf, and its launcher waited forever
    (["--nnodes", "1:2", "--rdzv_timeout", "inf"], "--rdzv_timeout inf: must be a finite"),
    (["--progress_timeout", "inf"], "--progress_timeout inf: must be a finite"),
    (["--stop_grace", "inf"], "--stop_grace inf: must be a finite"),
    (["--nnodes", "1:2", "--rdzv_timeout", "nan"], "--rdzv_timeout nan: must be"),
    # a finite but huge wait overflowed the keeper thread's queue timeout the same way
    (["--nnodes", "1:2", "--rdzv_timeout", "1e300"], "--rdzv_timeout 1e300: must be a finite"),
])
def test_an_infinite_number_of_seconds_is_refused_at_start(tmp_path, capsys, argv, message):
    port = str(free_port())
    assert message in launch_fails(tmp_path, capsys, [*argv, "--master_port", port])


def test_one_port_for_the_rendezvous_and_the_coordinator_is_refused(tmp_path, capsys):
    port = str(free_port())
    line = launch_fails(tmp_path, capsys, ["--nnodes", "2", "--master_port", port,
                                           "--rdzv_port", port])
    assert f"--rdzv_port {port} is also --master_port" in line, line


@pytest.mark.parametrize("name, value, words", [
    ("JDP_INIT_TIMEOUT", "abc", ["whole number of seconds", "JDP_INIT_TIMEOUT=60"]),
    ("JDP_HEARTBEAT_TIMEOUT", "0.5", ["whole number of seconds"]),
    ("JDP_SHUTDOWN_TIMEOUT", "inf", ["whole number of seconds"]),
    ("JDP_PROGRESS_TIMEOUT", "inf", ["number of seconds > 0 and <= 604800"]),
    ("JDP_STOP_GRACE", "nan", ["seconds > 0"]),
    ("JDP_INIT_TIMEOUT", "1e12", ["whole number of seconds >= 1 and <= 604800"]),
    ("JDP_MALLOC_TUNING", "maybe", ["is not one of", "JDP_MALLOC_TUNING=0"]),
])
def test_a_bad_jdp_variable_stops_the_launcher_naming_it_and_its_value(tmp_path, capsys,
                                                                       monkeypatch, name,
                                                                       value, words):
    monkeypatch.setenv(name, value)
    line = launch_fails(tmp_path, capsys, [])
    for word in [name, value, *words]:
        assert word in line, (word, line)


@pytest.mark.parametrize("name, value", [("JDP_PROGRESS_TIMEOUT", "abc"),
                                         ("JDP_INIT_TIMEOUT", "-3")])
def test_initialize_alone_refuses_a_bad_jdp_variable_instead_of_ignoring_it(monkeypatch, name,
                                                                           value):
    # One process with no launcher used to return quietly: the watchdog silently off.
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        jdp.initialize()
    assert_one_line(info.value, [f"{name}={value!r}", "unset it"])


def test_spawn_refuses_a_bad_progress_timeout_naming_the_variable(monkeypatch):
    monkeypatch.setenv("JDP_PROGRESS_TIMEOUT", "abc")
    with pytest.raises(ValueError) as info:
        jdp.spawn(print, nprocs=1)
    assert_one_line(info.value, ["JDP_PROGRESS_TIMEOUT='abc'", "seconds"])


UNDER_MPIRUN = """
import jdp
try:
    jdp.initialize()
    print("joined", flush=True)
except ValueError as e:
    print(f"ValueError: {e}", flush=True)
"""


@pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI) is not installed")
def test_under_mpirun_a_bad_jdp_variable_is_named_by_every_rank_before_joining(tmp_path, tag):
    script = write_script(tmp_path, "mpi.py", UNDER_MPIRUN)
    done = subprocess.run(mpirun_command(script, ("JAX_PLATFORMS", "PYTHONPATH",
                                                  "JDP_TEST_TAG", "JDP_PROGRESS_TIMEOUT")),
                          env=job_env(tag, JDP_PROGRESS_TIMEOUT="abc"), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.count("ValueError: JDP_PROGRESS_TIMEOUT='abc' must be") == 2, \
        done.stdout + done.stderr
    assert "joined" not in done.stdout
