"""Every collective call is announced before its collective work: a process that skips one is
named on every process within seconds (exit code nonzero, no SIGABRT), whichever process skips
it (process 0, which holds the coordination service, or another) and with 2 or 3 processes.
Calls documented as local (`Checkpointer(...)`, `latest_step()`) run on one process alone.
A process slow to reach a call, before it ran any step, is waited for, not named.

Each case trains an epoch (4 steps), then every process but `skipper` makes the call (the
PyTorch habit `if rank == 0:` inverted, so that process 0 can be the one that skips), then
every process trains another epoch.
"""
import re
import time

import pytest
from conftest import job_env, start_launcher, write_script

SKIPS = """
    import sys, time
    import jax, jax.numpy as jnp, numpy as np, optax
    import jdp

    jdp.initialize()
    case, out, skipper = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rank = jax.process_index()
    x = np.random.default_rng(0).normal(size=(96, 3)).astype(np.float32)
    data = {"x": x, "y": x @ np.ones((3, 1), np.float32)}
    fsdp = case == "unshard"
    state = jdp.broadcast(jdp.TrainState.create(
        apply_fn=None, params={"w": jnp.zeros((3, 1))}, tx=optax.sgd(0.05)), shard_params=fsdp)
    step = jdp.train_step(lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
                          shard_params=fsdp)
    loader = jdp.data.Loader(data, batch_size=8)
    if case == "restore":   # built and saved on every process; restored on some
        shared = jdp.checkpoint.Checkpointer(out + "/ck")
        shared.save(0, state)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in loader:
            state, metrics = step(state, batch)
        if epoch == 1:
            break
        print(f"MISUSE {time.time()!r}", flush=True)
        if rank != skipper:
            if case == "checkpointer":   # built and saved inside the rank test
                jdp.checkpoint.Checkpointer(out + "/ck").save(1, state)
            elif case == "restore":
                state = shared.restore(state)
            elif case == "unshard":
                jdp.unshard(state)
            elif case == "latest_step":  # local: returns on one process
                print("LATEST", jdp.checkpoint.Checkpointer(out + "/ck").latest_step(),
                      flush=True)
    print("FINISHED", flush=True)
"""

WHO = {"checkpointer": "Checkpointer.save", "restore": "Checkpointer.restore",
       "unshard": "jdp.unshard"}
RUNS = [  # (case, processes, skipper): make test runs one of each case, make test-long the rest
    ("checkpointer", 2, 1), pytest.param("checkpointer", 3, 0, marks=pytest.mark.long),
    ("restore", 2, 0), pytest.param("restore", 3, 2, marks=pytest.mark.long),
    pytest.param("unshard", 2, 1, marks=pytest.mark.long), ("unshard", 3, 0)]


def run(tmp_path, tag, case, processes, skipper):
    script = write_script(tmp_path, "skips.py", SKIPS)
    launcher = start_launcher(["--nproc_per_node", processes, "--devices_per_process", "2",
                               "--logdir", tmp_path / "logs", script, case, tmp_path, skipper],
                              env=job_env(tag))
    out, err = launcher.communicate(timeout=150)
    return launcher, out, err, time.time()


@pytest.mark.parametrize("case, processes, skipper", RUNS)
def test_a_skipped_collective_call_is_named_on_every_process(tmp_path, tag, case, processes,
                                                             skipper):
    launcher, out, err, ended = run(tmp_path, tag, case, processes, skipper)
    assert launcher.returncode not in (0, None), err
    assert "FINISHED" not in out
    for rank in range(processes):   # every process names the call and the one that skipped
        logged = (tmp_path / "logs" / f"rank.{rank}" / "stderr").read_text()
        named = [line for line in logged.splitlines() if WHO[case] in line and (
            f"process(es) {skipper} skipped this call" in line or "took different paths" in line
            and f"process {skipper} " in line)]
        assert named, (rank, logged)
        assert "SIGABRT" not in logged and "Aborted" not in logged, logged
    misuse = min(float(t) for t in re.findall(r"MISUSE (\S+)", out))
    assert ended - misuse < 15 + 3, (ended - misuse, err)   # + the launcher's exit
    assert "lost process" not in err, err   # no rank is blamed for leaving


def test_local_calls_run_on_one_process_alone(tmp_path, tag):
    """Constructing a Checkpointer and `latest_step()` wait for no other process."""
    launcher, out, err, _ = run(tmp_path, tag, "latest_step", 2, 1)
    assert launcher.returncode == 0, err
    assert out.count("FINISHED") == 2 and out.count("LATEST None") == 1, out


SLOW_STARTER = """
    import time
    import jax, jax.numpy as jnp
    import jdp
    from jdp.distributed import _agree

    jdp.initialize()
    if jax.process_index() == 1:   # slow to start (a restart under load): asked where it is
        time.sleep(_agree.ANNOUNCE_S + 3)
    state = jdp.broadcast({"w": jnp.arange(3.0) * (1 + jax.process_index())})
    print("BROADCAST", [float(v) for v in jax.device_get(state["w"])], flush=True)
"""


@pytest.mark.long
def test_a_process_slow_to_reach_its_first_call_is_waited_for_not_named(tmp_path, tag):
    """Before its first step a process's progress slot is all zeros: it has run no step.
    (It read as step 0, so a peer that waited over ANNOUNCE_S in the first jdp.broadcast
    named it as having gone past the call: a restarted job died on a slow start.)"""
    script = write_script(tmp_path, "slow.py", SLOW_STARTER)
    launcher = start_launcher(["--nproc_per_node", 2, "--devices_per_process", 1, script],
                              env=job_env(tag))
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, err
    assert out.count("BROADCAST [0.0, 1.0, 2.0]") == 2, out
    assert "has waited" in err and "skipped" not in err, err
