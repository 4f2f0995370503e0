"""Replica groups that built different things stop before they train, every one of them with
the same line naming the difference and both values: another optimizer, layout, device or
process count, batch size, a plain sampler, a duplicated group index; and a group whose heal
would place a peer's state of another tree. The values named are computed here (optax's
leaves, the options given), and nothing may have been committed."""
import json
import subprocess
import sys
import time

import fault_tolerant as example
import jax
import optax
import pytest
from conftest import REPO, child_env, free_port

pytest.importorskip("torchft")
SCRIPT = f"{REPO}/tests/system/ft/ft_setup.py"
WIDTH = 32
FIX = "start every group with the same script and options"


def start(tmp_path, lighthouse, name, group, args, groups=2, processes=1, devices=2):
    """The processes of one group running ft_setup.py; its events go to ev{name}.jsonl."""
    extra = {"JDP_REPLICA_GROUP": str(group), "JDP_REPLICA_GROUPS": str(groups),
             "JDP_FT_LIGHTHOUSE": lighthouse, "JDP_FT_EVENTS": str(tmp_path / f"ev{name}.jsonl"),
             "RUST_LOG": "warn"}
    if processes > 1:
        extra.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                     WORLD_SIZE=str(processes))
    return [subprocess.Popen(
        [sys.executable, SCRIPT, "--width", str(WIDTH), *map(str, args)], cwd=REPO,
        env=child_env(devices=devices, **extra, **({"RANK": str(r)} if processes > 1 else {})),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(processes)]


def events(tmp_path, name):
    path = tmp_path / f"ev{name}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def wait_all(procs, timeout=120):
    """Each process's exit time and output (killed at the timeout)."""
    deadline, ended = time.monotonic() + timeout, {}
    while len(ended) < len(procs) and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.time()
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [ended.get(i) for i in range(len(procs))], [p.communicate()[0] for p in procs]


def error_line(log: str) -> str:
    lines = [x for x in log.splitlines() if x.startswith("RuntimeError: jdp.ft")]
    assert lines, log[-3000:]
    return lines[-1].removeprefix("RuntimeError: ")


def run_pair(tmp_path, lighthouse, a, b):
    """Groups 0 and 1 (each `(args, start kwargs)`), to their end: the line each group's
    process 0 raised (the same on both), checked to come within 10 s of the later group
    reaching the Lighthouse (its "connect", once its step compiled: on a busy machine the
    compilation alone took 8-10 s), with nothing committed and the line in each group's
    record. A group's other processes end too (they lose their process 0)."""
    groups = [start(tmp_path, lighthouse, name, kw.pop("group", name), args, **kw)
              for name, (args, kw) in enumerate((a, b))]
    procs = [p for group in groups for p in group]
    ended, logs = wait_all(procs)
    firsts = [procs.index(group[0]) for group in groups]
    # without a launcher to stop them, a group's other processes end as JAX ends a process
    # whose coordinator (process 0) is gone: SIGABRT
    # 78 (final: a launcher would not restart it) where jdp's exit hook runs (a job of
    # several processes); Python's own 1 for a process started alone
    assert all(procs[i].returncode in (1, 78) for i in firsts), logs
    assert all(p.returncode != 0 for p in procs), logs
    lines = {error_line(logs[i]) for i in firsts}
    assert len(lines) == 1, lines
    records = [events(tmp_path, name) for name in (0, 1)]
    joined = max(e["time"] for evs in records for e in evs if e["event"] == "connect")
    assert all(ended[i] - joined < 10.0 for i in firsts), (ended, joined)
    for evs in records:
        assert not [e for e in evs if e["event"] in ("commit", "start")], evs
        assert [e["reason"] for e in evs if e["event"] == "stop"] == list(lines), evs
    return lines.pop()


def test_another_optimizer_is_named_with_both_trees(tmp_path, lighthouse):
    line = run_pair(tmp_path, lighthouse, (["--optimizer", "adam"], {}),
                    (["--optimizer", "sgd"], {}))
    adam = len(jax.tree.leaves(optax.adam(0.1).init(example.init_params(WIDTH))))
    sgd = len(jax.tree.leaves(optax.sgd(0.1).init(example.init_params(WIDTH))))
    assert line.startswith("jdp.ft: replica groups 0 and 1 differ in the optimizer state's "
                           f"tree: ScaleByAdamState, EmptyState: {adam} leaves"), line
    assert f"on group 0, EmptyState: {sgd} leaves" in line and line.endswith(FIX), line


@pytest.mark.parametrize("a, b, words", [
    ((["--shard_params", 2], {"devices": 2}), (["--shard_params", 4], {"devices": 4}),
     "differ in the devices per group: 2 on group 0, 4 on group 1"),
    (([], {"processes": 2, "devices": 1}), ([], {}),
     "differ in the processes per group: 2 on group 0, 1 on group 1"),
    ((["--batch_size", 8], {}), (["--batch_size", 16], {}),
     "differ in the per-process batch size: 8 (drop_last=True) on group 0, 16 (drop_last=True)"
     " on group 1"),
    ((["--steps", 20], {}), (["--steps", 30], {}),
     "differ in the num_steps: 20 on group 0, 30 on group 1"),
    ((["--sync_every", 5], {}), ([], {}),
     "differ in the syncs (Replicas' sync_every and outer): LocalSGD, sync_every=5 on group 0, "
     "every step on group 1"),
], ids=["fsdp-2-vs-4-devices", "processes", "batch-size", "num-steps", "sync-every"])
def test_a_difference_in_layout_or_data_is_named_on_every_group(tmp_path, lighthouse, a, b,
                                                                words):
    line = run_pair(tmp_path, lighthouse, a, b)
    assert line == f"jdp.ft: replica groups 0 and 1 {words}; {FIX}", line


def test_localsgd_beside_diloco_is_named_with_the_outer_optimizers_state(tmp_path, lighthouse):
    line = run_pair(tmp_path, lighthouse, (["--sync_every", 5], {}),
                    (["--sync_every", 5, "--diloco"], {}))
    assert line.startswith("jdp.ft: replica groups 0 and 1 differ in the syncs (Replicas' "
                           "sync_every and outer): LocalSGD, sync_every=5 on group 0, DiLoCo, "
                           "sync_every=5, outer EmptyState"), line
    assert line.endswith(f"on group 1; {FIX}"), line


def test_replicated_beside_fsdp_is_named_by_the_step_options(tmp_path, lighthouse):
    """FSDP's parameters are arrays of the same shapes as replicated ones: the parameters'
    trees agree, and the step's options name the difference."""
    line = run_pair(tmp_path, lighthouse, ([], {}), (["--shard_params", 2], {}))
    assert line == ("jdp.ft: replica groups 0 and 1 differ in the train_step options: defaults "
                    f"on group 0, shard_params=2 on group 1; {FIX}"), line


def test_two_launchers_of_one_group_index_are_named(tmp_path, lighthouse):
    line = run_pair(tmp_path, lighthouse, ([], {"group": 0}), ([], {"group": 0}))
    assert line.startswith("jdp.ft: replica group 0 joined twice"), line


def test_a_plain_sampler_is_named_on_every_group(tmp_path, lighthouse):
    line = run_pair(tmp_path, lighthouse, ([], {}), (["--plain_sampler"], {}))
    assert line.startswith("jdp.ft: replica group 1: its loader's sampler is rank 0 of 1, not "
                           "rank 1 of 2 as jdp.ft.sampler gives"), line


def test_a_group_whose_heal_would_place_another_tree_stops_the_job(tmp_path, lighthouse):
    """Groups 0 and 1 of 3 start (min_groups=2) and train; group 2 joins later with a wider
    model: torchft heals it from a live peer, whose state it does not place; every group then
    names the parameters' trees."""
    common = ["--steps", 400, "--step_time", 0.05, "--start_timeout", 2, "--min_groups", 2]
    procs = [p for g in (0, 1) for p in start(tmp_path, lighthouse, g, g, common, groups=3)]
    deadline = time.monotonic() + 90
    while not any(e["event"] == "commit" for e in events(tmp_path, 0)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.1)
    procs += start(tmp_path, lighthouse, 2, 2, [*common, "--width", 2 * WIDTH], groups=3)
    ended, logs = wait_all(procs)
    assert all(p.returncode in (1, 78) for p in procs), logs
    lines = {error_line(log) for log in logs}
    assert len(lines) == 1, lines
    line = lines.pop()
    assert "differ in the parameters' tree" in line and line.endswith(FIX), line
    params = [jax.tree.leaves(example.init_params(w)) for w in (WIDTH, 2 * WIDTH)]
    for leaves in params:
        assert f"{sum(x.size for x in leaves)} values" in line, line
    assert not [e for e in events(tmp_path, 2) if e["event"] in ("commit", "heal")]
    joined = max(e["time"] for e in events(tmp_path, 2) if e["event"] == "connect")
    assert all(t - joined < 10.0 for t in ended), (ended, joined)
