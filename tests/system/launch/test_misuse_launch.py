"""Misusing the launcher, `jdp.initialize` and `jdp.spawn`: a one-line error naming the value.

Each case asserts the exception type or exit status, and that the message names what was
wrong, never a raw traceback, a signal or a hang.
"""
import glob
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, assert_one_line, free_port, job_env, run_python, write_script

import jdp
import jdp.launch

BAD_HOST = "no-such-host.invalid"


@pytest.mark.parametrize("argv, message", [
    (["--master_addr", BAD_HOST], f"--master_addr '{BAD_HOST}' does not resolve"),
    (["--master_addr", BAD_HOST, "--master_port", "29999"],
     f"--master_addr '{BAD_HOST}' does not resolve"),
    (["--progress_timeout", "0"], "--progress_timeout 0: must be a finite number of seconds > 0"),
    (["--stop_grace", "-1"], "--stop_grace -1: must be a finite number of seconds > 0"),
])
def test_bad_launcher_values_exit_2_with_one_line(tmp_path, capsys, argv, message):
    script = write_script(tmp_path, "ok.py", "print('never runs')\n")
    with pytest.raises(SystemExit) as exit_info:
        jdp.launch.main([*argv, script])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err.splitlines()[-1], err
    assert "Traceback" not in err


@pytest.mark.parametrize("value, message", [
    ("abc", "JDP_PROGRESS_TIMEOUT='abc' must be a number of seconds > 0"),
    ("-5", "JDP_PROGRESS_TIMEOUT='-5' must be a number of seconds > 0"),
])
def test_bad_progress_timeout_in_the_environment(tmp_path, capsys, monkeypatch, value, message):
    monkeypatch.setenv("JDP_PROGRESS_TIMEOUT", value)
    script = write_script(tmp_path, "ok.py", "print('never runs')\n")
    with pytest.raises(SystemExit) as exit_info:
        jdp.launch.main([script])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


TRY_INIT = """
import time
import jdp
start = time.monotonic()
try:
    jdp.initialize()
    print("joined")
except Exception as e:
    print(f"{type(e).__name__} after {time.monotonic() - start:.2f} s: {e}", flush=True)
"""


def test_rank_0_started_alone_raises_timeout_error_naming_the_missing_ranks(tmp_path):
    script = write_script(tmp_path, "init.py", TRY_INIT)
    done = run_python([script], env=job_env("alone", WORLD_SIZE="3", RANK="0",
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                                            JDP_INIT_TIMEOUT="3"), timeout=60)
    assert done.returncode == 0, done.stderr     # JAX itself aborts (SIGABRT) after ~66 s
    assert "TimeoutError after" in done.stdout, done.stdout
    assert "process(es) 1, 2 never reported" in done.stdout
    waited = float(done.stdout.split("after ", 1)[1].split(" s", 1)[0])
    assert 2.5 < waited < 10


def test_a_master_addr_that_does_not_resolve_fails_on_the_name_at_once(tmp_path):
    script = write_script(tmp_path, "init.py", TRY_INIT)
    done = run_python([script], env=job_env("unresolvable", WORLD_SIZE="2", RANK="1",
                                            MASTER_ADDR=BAD_HOST, MASTER_PORT="29999",
                                            JDP_INIT_TIMEOUT="60"), timeout=60)
    assert done.returncode == 0, done.stderr
    assert "ValueError after" in done.stdout and f"MASTER_ADDR='{BAD_HOST}'" in done.stdout
    waited = float(done.stdout.split("after ", 1)[1].split(" s", 1)[0])
    assert waited < 5, done.stdout


SPAWNING_PARENT = """
import sys
import jdp
import _spawn_targets as targets

if __name__ == "__main__":
    jdp.spawn(targets.fail_on_rank, args=(-1, sys.argv[1]), nprocs=2)
"""


def test_a_killed_spawn_parent_leaves_no_payload_behind(tmp_path, tag):
    """The pickled function, arguments and authkey are deleted once every rank has read them."""
    script = write_script(tmp_path, "parent.py", SPAWNING_PARENT)
    spool = tmp_path / "tmp"
    spool.mkdir()
    env = job_env(tag, PYTHONPATH=os.path.dirname(__file__) + os.pathsep + REPO,
                  TMPDIR=str(spool))
    parent = subprocess.Popen([sys.executable, script, str(tmp_path)], env=env, cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pid{r}").exists() for r in (0, 1)):   # both ranks run fn
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.05)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    assert glob.glob(str(spool / "jdp-spawn-*" / "payload.pkl")) == []
    assert glob.glob(str(spool / "jdp-spawn-*"))   # the spool was used (the test saw it)


# --- issue 26 ------------------------------------------------------------------------------

def test_a_directory_with_main_runs_as_python_runs_it(tmp_path, tag):
    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text("import helper\n")
    (app / "helper.py").write_text("import jdp\njdp.initialize()\n"
                                   "print('ran as rank', jdp.process_index(), flush=True)\n")
    done = run_python(["-m", "jdp.launch", "--nproc_per_node", "2", str(app)], env=job_env(tag),
                      timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ran as rank 0" in done.stdout and "ran as rank 1" in done.stdout


@pytest.mark.parametrize("what, message", [
    ("empty_dir", "is a directory without __main__.py; pass the script inside it"),
    ("logdir_file", "is a file, not a directory; pass a directory path"),
])
def test_a_directory_without_main_or_a_logdir_that_is_a_file(tmp_path, capsys, what, message):
    script = write_script(tmp_path, "ok.py", "print('never runs')\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "taken").write_text("")
    argv = ([str(tmp_path / "empty")] if what == "empty_dir" else
            ["--logdir", str(tmp_path / "taken"), script])
    with pytest.raises(SystemExit) as exit_info:
        jdp.launch.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err.splitlines()[-1], err
    assert "Traceback" not in err


GUARDED_FN = """
import jdp

if __name__ == "__main__":
    def main(rank):
        print("never runs")

    try:
        jdp.spawn(main, nprocs=2)
    except ValueError as e:
        print(f"ValueError: {e}")
"""


def test_spawn_of_a_function_defined_under_the_main_guard_says_to_move_it(tmp_path, tag):
    script = write_script(tmp_path, "guarded.py", GUARDED_FN)
    done = run_python([script], env=job_env(tag), timeout=60)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith("ValueError: fn=main is defined under `if __name__ == '__main__':`")
    assert "define it at module level" in line and "\n" not in line
    assert "never runs" not in done.stdout


@pytest.mark.parametrize("args", [5, "ab", {"a": 1}])
def test_spawn_args_that_are_not_a_tuple(args):
    with pytest.raises(TypeError) as info:
        jdp.spawn(print, args=args, nprocs=2)
    assert_one_line(info.value, [f"args={args!r} must be a tuple", f"args=({args!r},)"])
