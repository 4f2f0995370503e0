"""The launcher does not restart a job whose rank failed with the final status 78 (a failure
a restart cannot mend), however many restarts are left; any other failure is restarted."""
from conftest import job_env, start_launcher, write_script

FAILS = """
import os, sys
print("RUN", os.environ["JDP_RESTART_COUNT"], flush=True)
error = RuntimeError("jdp.ft: replica groups 0 and 1 differ")
if sys.argv[1] == "final":
    error.jdp_exit_code = 78
raise error
"""


def run(tmp_path, tag, kind):
    script = write_script(tmp_path, "fails.py", FAILS)
    proc = start_launcher(["--max_restarts", 2, script, kind], job_env(tag))
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def test_a_final_failure_is_not_restarted(tmp_path, tag):
    code, out, err = run(tmp_path, tag, "final")
    assert code == 78, err
    assert out.count("RUN") == 1, out


def test_any_other_failure_is(tmp_path, tag):
    code, out, err = run(tmp_path, tag, "other")
    assert code == 1, err
    assert out.count("RUN") == 3, out   # the first round and its 2 restarts
