"""Restarts across nodes: a failure on one node restarts the ranks of every node together.

Two launchers on 127.0.0.1 play two nodes of 2 ranks each (--nnodes 2, --max_restarts 1).
Rank 3 (node 1) is SIGKILLed mid-run: both launchers must report the same first failure and
restart round 1, the job must resume from its last checkpoint and finish (both exit 0), and
no surviving rank may die of JAX's aborts ("different incarnation", SIGABRT).
"""
import json
import os
import signal
import subprocess
import time

import pytest
from conftest import free_port, job_env, job_processes, start_launcher, write_script

TRAIN = """
import os, sys, time
import jax, jax.numpy as jnp, numpy as np, optax
import jdp

jdp.initialize()
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 4)).astype(np.float32)
y = x @ np.arange(4, dtype=np.float32)
state = jdp.TrainState.create(apply_fn=None, params={"w": jnp.zeros(4)}, tx=optax.sgd(0.05))
step = jdp.train_step(lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2))
state = jdp.broadcast(state)
sampler = jdp.data.DistributedSampler(len(x), shuffle=True, seed=0)
loader = jdp.data.Loader({"x": x, "y": y}, batch_size=8, sampler=sampler, layout="global")
ckpt = jdp.checkpoint.Checkpointer(sys.argv[1])
state = ckpt.restore(state, loader=loader)
n = ckpt.latest_step() or 0
print(f"START round {os.environ['JDP_RESTART_COUNT']} from step {n}", flush=True)
for epoch in range(loader.epoch, 4):
    loader.set_epoch(epoch)
    for batch in loader:
        state, metrics = step(state, batch)
        n += 1
        if n % 4 == 0:
            ckpt.save(n, state, loader=loader)
        print(f"STEP {n}", flush=True)
        time.sleep(0.2)
print("FINAL", n, np.asarray(state.params["w"]).tolist(), flush=True)
"""
ABORTS = ("incarnation", "SIGABRT", "Check failed", "Fatal Python error")


def rank_pid(tag: str, rank: int) -> int | None:
    for p in job_processes(tag):
        try:
            if p.environ().get("RANK") == str(rank) and "jdp/job/run.py" in " ".join(p.cmdline()):
                return p.pid
        except Exception:
            continue
    return None


def wait_for_line(path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, f"{path} never showed {text!r}"
        time.sleep(0.1)


@pytest.mark.long
def test_a_rank_killed_on_node_1_restarts_every_node_in_one_round(tmp_path, tag):
    script = write_script(tmp_path, "train.py", TRAIN)
    logs, port = tmp_path / "logs", free_port()
    consoles = [tmp_path / f"node{k}.txt" for k in (0, 1)]
    nodes = []
    for k in (0, 1):
        with open(consoles[k], "w") as f:
            nodes.append(start_launcher(
                ["--nnodes", 2, "--node_rank", k, "--nproc_per_node", 2, "--master_port", port,
                 "--max_restarts", 1, "--logdir", logs, "--redirect_stdout_and_stderr", script,
                 tmp_path / "ckpt"], job_env(tag), stdout=f, stderr=subprocess.STDOUT))
    wait_for_line(logs / "rank.3" / "stdout", "STEP 6", timeout=180)
    os.kill(rank_pid(tag, 3), signal.SIGKILL)
    codes = [p.wait(timeout=300) for p in nodes]
    texts = [c.read_text() for c in consoles]
    assert codes == [0, 0], texts
    for text in texts:   # one summary per launcher, naming the killed rank and its node
        assert text.count("rank 3 on node 1 failed with signal SIGKILL") == 1, text
        assert "restart 1 of 1" in text, text
        assert not any(word in text for word in ABORTS), text
    for rank in range(4):
        out = (logs / f"rank.{rank}" / "stdout").read_text()
        resumed = int(out.split("START round 1 from step ", 1)[1].split()[0])
        assert resumed >= 4 and resumed % 4 == 0, out     # the last checkpoint, not step 0
        assert "FINAL 32" in out, out
        err = (logs / f"rank.{rank}" / "stderr").read_text()
        assert not any(word in err for word in ABORTS), (rank, err[-3000:])
    # node 0's launcher merged both nodes' goodput: one summary, per-node detail kept
    summary = json.loads((logs / "summary.json").read_text())
    assert sorted(summary["ranks"]) == ["0", "1", "2", "3"] and sorted(summary["nodes"]) == [
        "0", "1"], summary
    assert sum(summary["buckets_s"].values()) == pytest.approx(summary["wall_s"], rel=0.01)
    for detail in summary["ranks"].values():
        assert sum(detail["buckets_s"].values()) == pytest.approx(summary["wall_s"], rel=0.01)
    assert summary["rounds"] == 2 and len(summary["lost_steps"]) == 1, summary
    assert summary["buckets_s"]["lost"] > 0 and "on 2 nodes" in texts[0], texts[0][-2000:]


def test_losing_a_node_s_launcher_stops_the_job_on_every_node(tmp_path, tag):
    """SIGKILL to node 1's launcher (a lost node): its ranks die with it, node 0 stops its
    own at once and exits 1 naming the lost node (no restarts left)."""
    script = write_script(tmp_path, "train.py", TRAIN)
    logs, port = tmp_path / "logs", free_port()
    console = tmp_path / "node0.txt"
    args = ["--nnodes", 2, "--nproc_per_node", 2, "--master_port", port, "--logdir", logs,
            "--redirect_stdout_and_stderr"]
    with open(console, "w") as f:
        node0 = start_launcher([*args, "--node_rank", 0, script, tmp_path / "ckpt"],
                               job_env(tag), stdout=f, stderr=subprocess.STDOUT)
    node1 = start_launcher(   # killed below: it cannot remove a temporary compilation cache
        [*args, "--node_rank", 1, "--compilation_cache", tmp_path / "cache", script,
         tmp_path / "ckpt"], job_env(tag), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_line(logs / "rank.3" / "stdout", "STEP 4", timeout=180)
    node1.kill()
    node1.wait(timeout=10)
    start = time.monotonic()
    assert node0.wait(timeout=60) == 1, console.read_text()
    print(f"node 0's launcher exited {time.monotonic() - start:.1f} s after node 1's was killed")
    assert time.monotonic() - start < 10
    assert "lost the launcher of node 1" in console.read_text()
