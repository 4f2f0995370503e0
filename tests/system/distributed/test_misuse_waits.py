"""No silent wait over 10 s: a launcher waiting for node 0 or for its nodes, and a process
waiting for its peers in jdp.initialize, say what they wait for (which nodes or ranks, at which
address) and for how long at most, within 10 s, then at most once a minute. (A node whose
node 0 never came used to print nothing for 300 s.)"""
import subprocess
import time

import pytest
from conftest import free_port, job_env, run_python, start_launcher, wait_for_text, write_script

from jdp.job import waiting as _waiting

WAITS_S = 30   # how long a test looks for the line (announced after 5 s; the machine is busy)


def launcher_says(tmp_path, tag, argv, text) -> str:
    """Start a launcher that will wait, read its stderr until `text` shows, stop it."""
    script = write_script(tmp_path, "ok.py", "print('ran')\n")
    err_path = tmp_path / "launcher.err"
    with open(err_path, "w") as err:
        proc = start_launcher([*argv, script], job_env(tag), stdout=subprocess.DEVNULL,
                              stderr=err)
        try:
            wait_for_text(err_path, text, 1, WAITS_S)
        finally:
            proc.kill()
            proc.wait(timeout=10)
    return err_path.read_text()


def test_a_node_whose_node_0_never_comes_says_where_it_waits(tmp_path, tag):
    port = free_port()
    err = launcher_says(tmp_path, tag, ["--nnodes", "2", "--node_rank", "1", "--master_port",
                                        port], "waits for node 0's launcher")
    assert f"node 1 waits for node 0's launcher at 127.0.0.1:{port + 1}" in err, err
    assert "of at most 300 s" in err


def test_node_0_names_the_nodes_it_waits_for_and_its_address(tmp_path, tag):
    port = free_port()
    err = launcher_says(tmp_path, tag, ["--nnodes", "2", "--master_port", port],
                        "node 0 waits for node(s)")
    assert f"node 0 waits for node(s) [1] to connect at 127.0.0.1:{port + 1} (1 of 2 here" \
        in err, err
    assert "ran" not in err


def test_an_elastic_job_short_of_min_nodes_says_what_starts_a_round(tmp_path, tag):
    port = free_port()
    err = launcher_says(tmp_path, tag, ["--nnodes", "2:3", "--rdzv_timeout", "5",
                                        "--master_port", port], "node 0 waits for node(s)")
    assert "node(s) [1, 2]" in err and "--nnodes 2:3" in err and "--rdzv_timeout 5 s" in err, err


TRY_INIT = """
import jdp
try:
    jdp.initialize()
except TimeoutError as e:
    print("TimeoutError", flush=True)
"""


@pytest.mark.parametrize("rank, words", [
    ("0", ["process 0 waits at 127.0.0.1:{port} for process(es) 1, 2 of 3 to report",
           "of at most 7 s (JDP_INIT_TIMEOUT)"]),
    ("2", ["process 2 waits for process 0 at 127.0.0.1:{port}", "of at most 7 s"]),
])
def test_initialize_says_whom_it_waits_for_before_its_timeout(tmp_path, rank, words):
    port = free_port()
    script = write_script(tmp_path, "init.py", TRY_INIT)
    done = run_python([script], env=job_env("waits", WORLD_SIZE="3", RANK=rank,
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                            JDP_INIT_TIMEOUT="7"), timeout=90)
    assert "TimeoutError" in done.stdout, (done.stdout, done.stderr)
    for word in words:
        assert word.format(port=port) in done.stderr, (word, done.stderr)


def test_a_wait_repeats_its_line_at_most_once_per_period(capfd):
    seen = ""
    with _waiting.announced(lambda waited: "still waiting", first_s=0.01, every_s=3600):
        deadline = time.monotonic() + WAITS_S
        while "still waiting" not in seen and time.monotonic() < deadline:
            time.sleep(0.05)
            seen += capfd.readouterr().err
        time.sleep(0.3)
    seen += capfd.readouterr().err
    assert seen.count("still waiting") == 1, seen


def test_a_short_wait_says_nothing(capfd):
    with _waiting.announced(lambda waited: "never said"):
        pass
    assert "never said" not in capfd.readouterr().err
