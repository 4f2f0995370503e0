"""`jdp.evaluate` and `jdp.eval_step` agree across processes before their sum runs: on the
split (kind, size, batch_size) and on the metric tree (names, dtypes, per-device shapes).
A difference, or a split with fewer examples than processes, ends every process with the
same one line within seconds, exit code nonzero, no SIGABRT (2 processes x 2 devices under
`python -m jdp.launch`); agreeing processes get the exact mean on both.
"""
import json
import re
import time

import numpy as np
import pytest
from conftest import job_env, start_launcher, write_script

SCRIPT = """
    import json, sys, time
    import jax, jax.numpy as jnp, numpy as np
    import jdp

    jdp.initialize()
    case, out = sys.argv[1], sys.argv[2]
    rank = jax.process_index()
    x = np.arange(20, dtype=np.float32)
    data = {"few": {"x": x[:1]}, "sizes": {"x": x[:10 + rank]}}.get(case, {"x": x})
    name = "sq2" if case in ("names", "eval_step") and rank == 1 else "sq"
    dtype = jnp.bfloat16 if case == "dtypes" and rank == 1 else jnp.float32
    metric = lambda s, b: {name: ((b["x"] * s["w"]) ** 2).astype(dtype)}
    state = jdp.broadcast({"w": np.float32(2)})
    print(f"MISUSE {time.time()!r}", flush=True)
    try:
        if case == "eval_step":
            step = jdp.eval_step(metric)
            result = [float(step(state, b)["count"]) for b in jdp.data.Loader(data, 4)]
        else:
            result = jdp.evaluate(metric, state, data, batch_size=4)
    except Exception as e:   # recorded, then a moment for the other process to record its
        open(f"{out}/rank{rank}.txt", "w").write(f"{type(e).__name__}: {e}")
        time.sleep(1)         # own before the launcher, seeing this one fail, stops the job
        raise
    json.dump(result, open(f"{out}/rank{rank}.json", "w"))
    print("FINISHED", flush=True)
"""

CASES = {   # case: the words each process's one line names
    "names": ["ValueError: jdp.evaluate", "disagree on ['sq']: float32[2] on process(es) 0 but "
              "absent on process(es) 1", "same metrics"],
    "eval_step": ["ValueError: jdp.eval_step", "disagree on ['sq']: float32[2] on process(es) 0 "
                  "but absent on process(es) 1", "same metrics"],
    "dtypes": ["ValueError: jdp.evaluate", "disagree on ['sq']: float32[2] on process(es) 0 but "
               "bfloat16[2] on process(es) 1"],
    "few": ["ValueError: jdp.evaluate", "the split has 1 example(s) for 2 processes",
            "at least 2 examples"],
    "sizes": ["ValueError: jdp.evaluate", "disagree on the split's examples",
              "10 on process(es) 0", "11 on process(es) 1", "same split"],
}


def run_job(tmp_path, tag, case):
    script = write_script(tmp_path, "evaluate.py", SCRIPT)
    launcher = start_launcher(["--nproc_per_node", "2", "--devices_per_process", "2", script,
                               case, tmp_path], env=job_env(tag))
    out, err = launcher.communicate(timeout=180)
    return launcher.returncode, out, err, time.time()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_difference_ends_every_process_with_the_same_line_within_seconds(tmp_path, tag,
                                                                           case):
    code, out, err, ended = run_job(tmp_path, tag, case)
    assert code not in (0, None), err
    assert "FINISHED" not in out
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert lines[0] == lines[1] and "\n" not in lines[0], lines   # every process, one line
    assert all(w in lines[0] for w in CASES[case]), lines[0]
    misuse = [float(t) for t in re.findall(r"MISUSE (\S+)", out)]   # just before the call
    assert misuse and ended - min(misuse) < 10 + 5, (misuse, ended, err)   # + the launcher's exit
    assert "SIGABRT" not in err and "signal 6" not in err and "Aborted" not in err, err


def test_agreeing_processes_get_the_exact_mean_on_both(tmp_path, tag):
    code, out, err, _ = run_job(tmp_path, tag, "ok")
    assert code == 0, err[-3000:]
    x = np.arange(20, dtype=np.float64)   # independent: the mean of (2 x)^2 over the split
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"sq": float(np.mean((2 * x) ** 2)), "count": 20.0}
