"""A launcher killed by SIGKILL removes nothing: its progress slots and its temporary
compilation cache stay in the temporary directory until the next launcher on the host,
which removes them before it starts its own job, and its own at its end."""
import subprocess
import time

from conftest import job_env, run_python, start_launcher, wait_until_gone, write_script

from jdp.launch import _scratch

KINDS = ("watch", "compilation-cache")


def _scratch_dirs(spool) -> dict:
    return {k: sorted(p.name for p in spool.glob(f"jdp-{k}-*")) for k in KINDS}


def test_the_next_launcher_removes_what_a_killed_one_left(tmp_path, tag):
    spool = tmp_path / "tmp"
    spool.mkdir()
    env = job_env(tag, TMPDIR=str(spool))
    waits = write_script(tmp_path, "waits.py", "import time\nprint('UP', flush=True)\n"
                                               "time.sleep(300)\n")
    first = start_launcher(["--nproc_per_node", 1, waits], env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not all(_scratch_dirs(spool).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _scratch_dirs(spool)
    assert all(len(names) == 1 for names in left.values()), left
    host = _scratch._host()
    for kind, (name,) in left.items():
        assert name.startswith(f"jdp-{kind}-{host}-{first.pid}-"), name
    first.kill()
    first.wait(timeout=10)
    wait_until_gone(tag, timeout=30)   # its rank dies with it
    assert _scratch_dirs(spool) == left   # nothing ran to remove them

    ok = write_script(tmp_path, "ok.py", "print('DONE', flush=True)\n")
    second = run_python(["-m", "jdp.launch", "--nproc_per_node", "1", ok], env=env)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "DONE" in second.stdout
    assert _scratch_dirs(spool) == {k: [] for k in KINDS}
