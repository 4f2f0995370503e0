"""The PyTorch habit `if rank == 0:` around a call every process must make, and its cousins:
named on every process within seconds, the job's exit code nonzero, never a hang, never a
SIGABRT, never the innocent rank blamed (2 processes x 2 devices under `python -m jdp.launch`;
a script that ends early under a real `mpirun -np 2` and `srun -n 2` too).

Each case trains 4 steps an epoch; the misuse comes at the end of the first epoch.
"""
import re
import subprocess
import sys
import time

import pytest
from conftest import (
    MPIRUN,
    REPO,
    child_env,
    job_env,
    mpirun_command,
    start_launcher,
    write_script,
)

HABIT = """
    import sys, time
    import jax, jax.numpy as jnp, numpy as np, optax
    import jdp

    jdp.initialize()
    case, out = sys.argv[1], sys.argv[2]
    rank = jax.process_index()
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    data = {"x": x, "y": x @ np.ones((3, 1), np.float32)}
    shard = 2 if case == "options" and rank == 1 else False
    state = jdp.broadcast(jdp.TrainState.create(
        apply_fn=None, params={"w": jnp.zeros((3, 1))}, tx=optax.sgd(0.05)), shard_params=shard)
    step = jdp.train_step(lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
                          shard_params=shard)
    metric = lambda s, b: {"sq": jnp.sum((b["x"] @ s.params["w"] - b["y"]) ** 2, -1)}
    loader = jdp.data.Loader(data, batch_size=8)
    evaluate = jdp.eval_step(metric)
    ckpt = jdp.checkpoint.Checkpointer(out + ("/ck" if case != "directory" else f"/ck{rank}"))
    for epoch in range(3):
        loader.set_epoch(epoch)
        batches = loader if case != "no_loader" else [   # jdp.shard's rows: no Loader epochs
            jdp.shard({k: v[8 * i + 4 * rank:8 * i + 4 * rank + 4] for k, v in data.items()})
            for i in range(4)]
        for batch in batches:
            state, metrics = step(state, batch)
        if case == "script_ends" and rank == 1:
            sys.exit(0)
        print(f"MISUSE {time.time()!r}", flush=True)
        if case in ("evaluate", "no_loader") and rank == 0:
            jdp.evaluate(metric, state, data)
        if case == "eval_step" and rank == 0:
            evaluate(state, batch)
        if case == "save" and rank == 0 or case == "directory":
            ckpt.save(epoch + 1, state)
        if case == "script_ends":
            jdp.evaluate(metric, state, data)
    print("FINISHED", flush=True)
"""

CASES = {   # case: the words of the one line (first: the call it names)
    "evaluate": ["jdp.evaluate", "jax.process_index() == 0"],
    "eval_step": ["jdp.eval_step", "jax.process_index() == 0"],
    "save": ["Checkpointer.save", "jax.process_index() == 0"],
    "no_loader": ["jdp.evaluate", "process(es) 1 skipped this call", "went on to step",
                  "remove the `if jax.process_index() == 0:`"],
    "script_ends": ["jdp.evaluate", "process(es) 1 skipped this call",
                    "process 1 finished its script after step 4"],
    "options": ["jdp.train_step", "disagree on shard_params", "False on process(es) 0",
                "2 on process(es) 1"],
    "directory": ["Checkpointer.save", "disagree on the directory", "ck0 on process(es) 0",
                  "ck1 on process(es) 1", "one shared directory"],
}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.long) if case == "no_loader"
                                  else case for case in sorted(CASES)])
def test_a_call_not_every_process_makes_is_named_within_seconds(tmp_path, tag, case):
    script = write_script(tmp_path, "habit.py", HABIT)
    start = time.time()
    launcher = start_launcher(["--nproc_per_node", "2", "--devices_per_process", "2", script,
                               case, tmp_path], env=job_env(tag))
    out, err = launcher.communicate(timeout=120)
    ended = time.time()
    assert launcher.returncode not in (0, None), err
    assert "FINISHED" not in out
    named = [line for line in err.splitlines() if all(w in line for w in CASES[case])]
    assert named, err   # the one line naming the call and the fix (from either process)
    misuse = [float(t) for t in re.findall(r"MISUSE (\S+)", out)] or [start]
    assert ended - min(misuse) < 15 + 3, (ended - min(misuse), err)   # + the launcher's exit
    assert "SIGABRT" not in err and "signal 6" not in err and "Aborted" not in err, err
    assert "lost process" not in err, err   # no rank is blamed for leaving


@pytest.mark.parametrize("engine", ["mpirun", "srun"])
def test_under_mpirun_and_srun_a_script_that_ends_early_is_named_too(tmp_path, tag, engine):
    """No jdp launcher: the roll call's connections say that process 1's script ended."""
    from test_fault_slurm import SRUN, slurm_ready
    if engine == "mpirun" and MPIRUN is None or engine == "srun" and not slurm_ready():
        pytest.skip(f"{engine} is not installed or not running here")
    script = write_script(tmp_path, "habit.py", HABIT)
    env = child_env(2, JDP_TEST_TAG=tag)
    command = (mpirun_command(script, ["JAX_PLATFORMS", "XLA_FLAGS", "PYTHONPATH",
                                       "JDP_TEST_TAG"], "script_ends", str(tmp_path))
               if engine == "mpirun" else
               [SRUN, "-n", "2", "--overcommit", sys.executable, script, "script_ends",
                str(tmp_path)])
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0, done.stdout + done.stderr
    out = done.stdout + done.stderr
    assert "FINISHED" not in out
    assert all(w in out for w in CASES["script_ends"]), out
    assert "SIGABRT" not in out and "signal 6" not in out, out
