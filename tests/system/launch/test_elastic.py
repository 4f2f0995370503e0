"""Elastic jobs (`--nnodes MIN:MAX`): a lost node does not end the job, a returning one rejoins.

Three launchers on 127.0.0.1 play three nodes of one process each (1 CPU device; 2 under
HSDP in the lost-node test, where the groups are rebuilt from the checkpoint). Every rank
logs the example ids it trains at each step; the ids that count are those of the steps the
final state descends from: round q's steps up to the step round q+1 restored from. Together
they must be every example of the epoch exactly once (an independent count, from the logs,
not from the Loader's own bookkeeping).
"""
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections import Counter

import numpy as np
import pytest
from conftest import (
    free_port,
    job_env,
    job_processes,
    start_launcher,
    wait_until_gone,
    write_script,
)

N = 120               # examples in the epoch
BATCH = 2             # per process: 3 processes train 6 examples a step, 2 train 4
RDZV_TIMEOUT = 5

TRAIN = """
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np, optax
import jdp

jdp.initialize()
N = int(sys.argv[2])
rng = np.random.default_rng(0)
x = rng.normal(size=(N, 4)).astype(np.float32)
source = {"x": x, "y": x @ np.arange(4, dtype=np.float32), "id": np.arange(N)}
state = jdp.TrainState.create(apply_fn=None, params={"w": jnp.zeros(4)}, tx=optax.sgd(0.05))
step = jdp.train_step(lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2))
state = jdp.broadcast(state)
sampler = jdp.data.DistributedSampler(N, shuffle=True, seed=0)
loader = jdp.data.Loader(source, batch_size=int(sys.argv[3]), sampler=sampler)
ckpt = jdp.checkpoint.Checkpointer(sys.argv[1])
state = ckpt.restore(state, loader=loader)
n = ckpt.latest_step() or 0
r, env = int(os.environ["JDP_RESTART_COUNT"]), os.environ
print("START " + json.dumps({"round": r, "from": n, "world": jax.process_count(),
      "nnodes": int(env["JDP_NNODES"]), "node": int(env["NODE_RANK"]), "rank": int(env["RANK"]),
      "time": time.time()}), flush=True)
for epoch in range(loader.epoch, 1):
    loader.set_epoch(epoch)
    for batch in loader:
        state, metrics = step(state, batch)
        n += 1
        ids = np.concatenate([np.asarray(s.data) for s in batch["id"].addressable_shards])
        mask = np.concatenate([np.asarray(s.data) for s in batch["mask"].addressable_shards])
        print("IDS " + json.dumps({"round": r, "step": n, "ids": ids[mask].tolist(),
                                   "time": time.time()}), flush=True)
        ckpt.save(n, state, loader=loader)
        if jdp.preempted():   # also the launcher's planned restart when a node joins
            break
        time.sleep(0.3)
print("FINAL " + json.dumps({"round": r, "step": n, "world": jax.process_count()}), flush=True)
"""


def records(text: str, kind: str) -> list:
    """The `kind` records of complete lines (a rank killed mid-print leaves a partial one).

    A rank's stdout and stderr share one pipe, and gloo writes its log lines to stderr in
    pieces, so a piece can land before a record on its line ("[Gloo] Rank IDS {...}") or after
    it: each record is the JSON value after the first `kind` marker of its line."""
    decode, marker = json.JSONDecoder().raw_decode, kind + " {"
    return [decode(line[line.index(marker) + len(kind) + 1:])[0]
            for line in text.split("\n")[:-1] if marker in line]


def launcher(tmp_path, tag, port, node, script, devices=1, batch=BATCH):
    """Node `node`'s launcher of the 2:3 job, its console in nodeK.txt (appended)."""
    args = ["--nnodes", "2:3", "--rdzv_timeout", RDZV_TIMEOUT, "--node_rank", node,
            "--nproc_per_node", 1, "--devices_per_process", devices, "--master_port", port,
            "--max_restarts", 2, "--logdir", tmp_path / f"logs{node}",
            "--redirect_stdout_and_stderr", "--compilation_cache", tmp_path / "cache", script,
            tmp_path / "ckpt", N, batch]
    with open(tmp_path / f"node{node}.txt", "a") as console:
        return start_launcher(args, job_env(tag), stdout=console, stderr=subprocess.STDOUT)


def rank_log(tmp_path, node: int) -> str:
    """Everything node `node`'s ranks printed, over all rounds (a rank's number changes with
    the rounds, so every rank.K of that node's log directory)."""
    root = tmp_path / f"logs{node}"
    texts = [(root / d / "stdout").read_text() for d in sorted(os.listdir(root))
             if d.startswith("rank.")]
    return "".join(text[:text.rfind("\n") + 1] for text in texts)   # complete lines only


def wait_for(predicate, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def steps_of(tmp_path, node: int, round_: int) -> int:
    root = tmp_path / f"logs{node}"
    if not root.exists():
        return 0
    return sum(1 for rec in records(rank_log(tmp_path, node), "IDS") if rec["round"] == round_)


def kill_node(tag: str, node_launcher: subprocess.Popen) -> float:
    """SIGKILL a node's launcher and its rank together; the time of the kill."""
    pids = [p.pid for p in job_processes(tag)
            if p.ppid() == node_launcher.pid or p.pid == node_launcher.pid]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):   # a rank that left as its launcher died
            os.kill(pid, signal.SIGKILL)
    node_launcher.wait(timeout=10)
    return time.time()


def last_final(tmp_path, node: int) -> dict:
    """The FINAL record of the node's last round."""
    return max(records(rank_log(tmp_path, node), "FINAL"), key=lambda rec: rec["round"])


def kept_steps(tmp_path, nodes) -> list:
    """Every rank's IDS records of the steps the final state descends from: round q's steps up
    to the step round q+1 restored from."""
    starts, steps = {}, []
    for node in nodes:
        text = rank_log(tmp_path, node)
        starts.update({rec["round"]: rec["from"] for rec in records(text, "START")})
        steps += records(text, "IDS")
    rounds = sorted(starts)
    kept = []
    for rec in steps:
        later = [starts[q] for q in rounds if q > rec["round"]]
        if not later or rec["step"] <= later[0]:   # not redone by the round after
            kept.append(rec)
    return kept


def trained_once(tmp_path, nodes) -> Counter:
    """How often each example id was trained in the steps the final state descends from."""
    return Counter(i for rec in kept_steps(tmp_path, nodes) for i in rec["ids"])


def stop_all(nodes) -> None:
    """Kill and reap every launcher still running (a failing test leaves none behind)."""
    for p in nodes:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def start_job(tmp_path, tag, text=TRAIN, **options):
    script = write_script(tmp_path, "train.py", text)
    port = free_port()
    return script, port, [launcher(tmp_path, tag, port, k, script, **options) for k in range(3)]


def edited(text: str, *edits: tuple[str, str]) -> str:
    """`text` with each (old, new) replaced; every old must be there."""
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    return text


HSDP = edited(   # TRAIN, with shard_params="node" and a masked loss the test can replay
    TRAIN,
    ('x @ np.arange(4, dtype=np.float32)', 'x @ rng.normal(size=(4, 6)).astype(np.float32)'),
    ('params={"w": jnp.zeros(4)}, tx=optax.sgd(0.05)',
     'params={"w": jnp.zeros((4, 6))}, tx=optax.sgd(0.05, momentum=0.9)'),
    ('step = jdp.train_step(lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2))',
     'step = jdp.train_step(lambda p, b: jnp.sum(b["mask"] * jnp.sum((b["x"] @ p["w"] - '
     'b["y"]) ** 2, axis=1)) / b["mask"].shape[0], shard_params="node")'),
    ('state = jdp.broadcast(state)', 'state = jdp.broadcast(state, shard_params="node")'),
    ('"ids": ids[mask].tolist(),', '"ids": ids[mask].tolist(), "rows": batch["mask"].shape[0],'),
    ('"world": jax.process_count()}), flush=True)',
     '"world": jax.process_count(), '
     '"group": dict(state.params["w"].sharding.mesh.shape).get("jdp_shard"), '
     '"w": np.asarray(jdp.unshard(state).params["w"]).tolist()}), flush=True)'))


def replay(tmp_path, nodes) -> np.ndarray:
    """Single-device optax over the steps the final state descends from, each on the examples
    every rank logged for it (the loss: the masked squared error over the global batch)."""
    import jax
    import optax
    steps = {}           # (round, step) -> (global batch rows, every rank's example ids)
    for rec in kept_steps(tmp_path, nodes):
        steps.setdefault((rec["round"], rec["step"]), (rec["rows"], []))[1].extend(rec["ids"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 4)).astype(np.float32)
    y = x @ rng.normal(size=(4, 6)).astype(np.float32)
    tx, w = optax.sgd(0.05, momentum=0.9), np.zeros((4, 6), np.float32)
    opt = tx.init(w)

    def loss(w, ids, rows):
        return ((x[ids] @ w - y[ids]) ** 2).sum() / rows

    for _, (rows, ids) in sorted(steps.items()):
        grad = jax.grad(loss)(w, np.asarray(ids), rows)
        updates, opt = tx.update(grad, opt, w)
        w = optax.apply_updates(w, updates)
    return np.asarray(w)


@pytest.mark.long
def test_a_lost_node_leaves_the_others_to_finish_the_epoch_each_example_once(tmp_path, tag):
    """Three nodes of 2 devices under HSDP (shard_params="node": groups of 2, 3 copies of the
    model); node 1 is lost and the 2 left rebuild the groups (2 copies) from the checkpoint
    saved under 3. Every example is trained once, and the final parameters equal single-device
    optax replayed on the steps the logs show."""
    script, port, nodes = start_job(tmp_path, tag, text=HSDP, devices=2, batch=4)
    try:
        wait_for(lambda: steps_of(tmp_path, 1, 0) >= 3, "node 1 never ran 3 steps", 240)
        lost_at = kill_node(tag, nodes[1])
        codes = [nodes[k].wait(timeout=240) for k in (0, 2)]
    finally:
        stop_all(nodes)
    consoles = [(tmp_path / f"node{k}.txt").read_text() for k in range(3)]
    assert codes == [0, 0], consoles
    for k in (0, 2):   # one summary line for the round, on every launcher left
        line = re.findall(r"jdp.launch: round 1 .*", consoles[k])
        assert len(line) == 1 and "lost node 1" in line[0], consoles[k]
        assert "going on with 2 node(s), 2 processes" in line[0], line
        assert "lost the launcher of node 1" in consoles[k], consoles[k]
        assert last_final(tmp_path, k)["world"] == 2
    node2 = sorted(records(rank_log(tmp_path, 2), "START"), key=lambda rec: rec["round"])
    assert [(s["round"], s["world"], s["nnodes"], s["node"], s["rank"]) for s in node2] == [
        (0, 3, 3, 2, 2), (1, 2, 2, 1, 1)], node2   # renumbered densely in round 1
    kept = trained_once(tmp_path, (0, 1, 2))
    assert sorted(kept) == list(range(N)) and set(kept.values()) == {1}, kept
    finals = [last_final(tmp_path, k) for k in (0, 2)]
    assert [f["group"] for f in finals] == [2, 2], finals
    want = replay(tmp_path, (0, 1, 2))
    for f in finals:
        np.testing.assert_allclose(np.asarray(f["w"]), want, rtol=1e-4, atol=1e-5)
    first_step = min(rec["time"] for rec in records(rank_log(tmp_path, 0), "IDS")
                     if rec["round"] == 1)
    gap = first_step - lost_at
    restored = min(rec["time"] for rec in records(rank_log(tmp_path, 0), "START")
                   if rec["round"] == 1)
    print(f"loss of node 1 -> first step of round 1 on 2 nodes: {gap:.1f} s "
          f"(--rdzv_timeout {RDZV_TIMEOUT}; restored at {restored - lost_at:.1f} s)")
    assert gap < RDZV_TIMEOUT + 90   # rdzv wait + backoff + start, restore, compile (cached)
    wait_until_gone(tag, timeout=30)


@pytest.mark.long
def test_a_node_started_again_rejoins_and_the_job_ends_with_three(tmp_path, tag):
    script, port, nodes = start_job(tmp_path, tag)
    try:
        wait_for(lambda: steps_of(tmp_path, 1, 0) >= 3, "node 1 never ran 3 steps", 240)
        kill_node(tag, nodes[1])
        wait_for(lambda: steps_of(tmp_path, 0, 1) >= 3, "round 1 never ran 3 steps", 240)
        joined_at = time.time()
        nodes.append(launcher(tmp_path, tag, port, 1, script))
        codes = [nodes[k].wait(timeout=240) for k in (0, 2, 3)]
    finally:
        stop_all(nodes)
    consoles = [(tmp_path / f"node{k}.txt").read_text() for k in range(3)]
    assert codes == [0, 0, 0], consoles
    for k in range(3):
        line = re.findall(r"jdp.launch: round 2 .*", consoles[k])
        assert len(line) == 1 and "node 1 (" in line[0] and "joined" in line[0], consoles[k]
        assert "going on with 3 node(s), 3 processes" in line[0], line
        assert "planned restart" in line[0], line
        assert last_final(tmp_path, k)["world"] == 3
    kept = trained_once(tmp_path, (0, 1, 2))
    assert sorted(kept) == list(range(N)) and set(kept.values()) == {1}, kept
    starts = sorted(records(rank_log(tmp_path, 0), "START"), key=lambda rec: rec["round"])
    assert [s["world"] for s in starts] == [3, 2, 3], starts
    ends = [rec for rec in records(rank_log(tmp_path, 0), "IDS") if rec["round"] == 1]
    assert starts[2]["from"] == ends[-1]["step"], (starts, ends)   # nothing redone
    first_step = min(rec["time"] for rec in records(rank_log(tmp_path, 0), "IDS")
                     if rec["round"] == 2)
    print(f"node 1 started again -> first step of round 2 on 3 nodes: "
          f"{first_step - joined_at:.1f} s (launcher start, drain at one step, restart)")
    wait_until_gone(tag, timeout=30)


def test_losing_node_0_ends_the_job_on_every_node_with_what_to_do(tmp_path, tag):
    script, port, nodes = start_job(tmp_path, tag)
    try:
        wait_for(lambda: steps_of(tmp_path, 2, 0) >= 2, "node 2 never ran 2 steps", 240)
        lost_at = kill_node(tag, nodes[0])
        codes = [nodes[k].wait(timeout=60) for k in (1, 2)]
        waited = time.time() - lost_at
    finally:
        stop_all(nodes)
    for k in (1, 2):
        console = (tmp_path / f"node{k}.txt").read_text()
        assert "lost node 0's launcher" in console and "start the launchers again" in console
    assert codes == [1, 1]
    print(f"node 0 lost -> the other launchers exited after {waited:.1f} s")
    assert waited < 15
    wait_until_gone(tag, timeout=30)


# --- the round protocol without processes: launchers as threads, their ranks as callables ---

def node_thread(results, node, port, run_round, min_nodes=2, max_nodes=3, rdzv_timeout=3.0):
    """Node `node`'s launcher (_rounds.run) in a thread; its exit status lands in results.

    The rendezvous timeout is long enough for three threads to connect on a loaded machine
    (a round with all three starts at once; one with two waits for it)."""
    import threading

    from jdp.job.outcome import Job

    # private: the internals this test checks have no public name
    from jdp.launch import _rounds
    job = Job("jdp.launch", max_nodes, max_nodes, node)

    def target():
        results[node] = _rounds.run(job, 1, ("127.0.0.1", port), run_round, min_nodes,
                                    rdzv_timeout)
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def recording(places, node, until=None):
    """A run_round that records this node's Round per round and ends as `until(r, place)`."""
    from jdp.job.outcome import Outcome, State

    def run_round(r, place):
        places.setdefault(node, []).append((r, place[:4]))
        return until(r, place) if until else Outcome(State.SUCCEEDED)
    return run_round


def test_rounds_go_on_without_a_lost_node_renumbered_densely(capsys):
    from jdp.job import net as _net
    from jdp.job.outcome import Outcome, State
    port, places, results = free_port(), {}, {}

    def until_stopped(r, place):   # round 0 runs until the keeper stops it
        if r == 0:
            assert place.stop.wait(10), "round 0 was never stopped"
            return Outcome(State.STOPPED)
        return Outcome(State.SUCCEEDED)

    threads = [node_thread(results, k, port, recording(places, k, until_stopped))
               for k in (0, 2)]
    lost = _net.connect("127.0.0.1", port, 10)          # node 1, spoken by hand
    _net.send(lost, {"node": 1, "host": "host-b", "nproc": 1})
    assert _net.receive_one(lost, 10)["start"] == 0
    lost.close()                                        # its launcher vanishes mid-round
    for t in threads:
        t.join(timeout=20)
    assert results == {0: 0, 2: 0}
    assert places[0] == [(0, (0, 3, 0, 3)), (1, (0, 2, 0, 2))]
    assert places[2] == [(0, (2, 3, 2, 3)), (1, (1, 2, 1, 2))]   # NODE_RANK 1, RANK 1 now
    err = capsys.readouterr().err
    assert err.count("jdp.launch: lost the launcher of node 1 on host-b") == 2, err
    assert err.count("jdp.launch: round 1 (restart 1 of 1): lost node 1 (host-b); going on "
                     "with 2 node(s), 2 processes (node 2 is NODE_RANK 1)") == 2, err


def test_a_launcher_that_connects_mid_round_drains_it_and_joins_the_next(capsys):
    import threading

    from jdp.job import net as _net
    from jdp.job.outcome import Outcome, State
    port, places, results, joined = free_port(), {}, {}, threading.Event()

    def until_drained(r, place):   # round 0 (2 nodes) runs until the keeper drains it
        if r == 0:
            joined.set()
            assert place.drain.wait(10), "round 0 was never drained"
            assert not place.stop.is_set()
            return Outcome(State.STOPPED)
        return Outcome(State.SUCCEEDED)

    threads = [node_thread(results, k, port, recording(places, k, until_drained))
               for k in (0, 2)]
    assert joined.wait(20)
    twin = _net.connect("127.0.0.1", port, 10)          # a second node 2 is refused
    _net.send(twin, {"node": 2, "host": "host-c", "nproc": 1})
    refused = _net.receive_one(twin, 10)
    twin.close()
    assert refused["exit"] == 1 and "node 2 is already in the job" in refused["report"]
    threads.append(node_thread(results, 1, port, recording(places, 1)))
    for t in threads:
        t.join(timeout=20)
    assert results == {0: 0, 1: 0, 2: 0}
    assert places[0] == [(0, (0, 2, 0, 2)), (1, (0, 3, 0, 3))]
    assert places[1] == [(1, (1, 3, 1, 3))]
    assert places[2] == [(0, (1, 2, 1, 2)), (1, (2, 3, 2, 3))]
    err = capsys.readouterr().err
    assert err.count("jdp.launch: round 1 (a planned restart, not counted in --max_restarts): "
                     "node 1 (") == 3, err


def test_an_elastic_round_waits_for_min_nodes_and_says_who_is_missing():
    import types

    # private: the internals this test checks have no public name
    from jdp.launch import _rounds
    waiting = types.SimpleNamespace(min_nodes=2, max_nodes=3, nodes={0: "node 0"})
    assert "only 1 node(s) [0] connected within 300 s; --nnodes 2:3 needs at least 2: " \
           "start the launchers of more of the nodes [1, 2]" == _rounds.Keeper._missing(
               waiting, 300.0)


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2:x"], "--nnodes '2:x' is not a number of nodes M or a range MIN:MAX"),
    (["--nnodes", "3:2"], "--nnodes 3:2: must be M >= 1 or MIN:MAX with 1 <= MIN <= MAX"),
    (["--nnodes", "0"], "--nnodes 0: must be M >= 1"),
    (["--nnodes", "3", "--rdzv_timeout", "5", "--master_port", "1234"],
     "--rdzv_timeout 5 needs an elastic --nnodes MIN:MAX"),
    (["--nnodes", "1:3", "--node_rank", "3", "--master_port", "1234"],
     "--node_rank 3 is not in 0..2"),
])
def test_bad_elastic_arguments_exit_2_with_one_line(argv, message, capsys):
    import jdp.launch
    with pytest.raises(SystemExit) as exit_info:
        jdp.launch.main([*argv, "x.py"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_a_fixed_size_job_waits_for_the_lost_node_instead_of_going_on(capsys):
    """--nnodes 3 (fixed), as before elastic jobs: the round after a loss starts only when a
    launcher of the lost node is back, with the same numbering."""
    from jdp.job import net as _net
    from jdp.job.outcome import Outcome, State
    port, places, results = free_port(), {}, {}

    def until_stopped(r, place):
        if r == 0:
            assert place.stop.wait(10), "round 0 was never stopped"
            return Outcome(State.STOPPED)
        return Outcome(State.SUCCEEDED)

    threads = [node_thread(results, k, port, recording(places, k, until_stopped), min_nodes=None)
               for k in (0, 2)]
    lost = _net.connect("127.0.0.1", port, 10)
    _net.send(lost, {"node": 1, "host": "host-b", "nproc": 1})
    assert _net.receive_one(lost, 10)["start"] == 0
    lost.close()
    time.sleep(1.5)                                     # past the backoff: still waiting
    assert places[0] == [(0, (0, 3, 0, 3))] and places[2] == [(0, (2, 3, 2, 3))]
    threads.append(node_thread(results, 1, port, recording(places, 1), min_nodes=None))
    for t in threads:
        t.join(timeout=20)
    assert results == {0: 0, 1: 0, 2: 0}
    assert places[2] == [(0, (2, 3, 2, 3)), (1, (2, 3, 2, 3))]
    assert "restart 1 of 1: starting all 3 processes of 3 nodes again." in capsys.readouterr().err
