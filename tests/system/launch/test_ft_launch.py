"""`python -m jdp.launch --replica_group G --replica_groups R --ft_lighthouse ...`: the launcher
runs torchft's Lighthouse for its whole life (its ranks' restarts included), every rank gets
its group, the Lighthouse's address and the events file, and the group's events end up in the
summary; several launchers on one machine each run their own coordinator."""
import json
import os
import re
import socket

import pytest
from conftest import free_port, job_env, start_launcher, write_script

TIMEOUT = 60

# Every rank prints its environment and heartbeats to the Lighthouse (a real torchft client);
# process 0 appends the events the worker side writes. Round 0 fails when FAIL_ONCE is set.
RANK = """
import json, os, sys, time
from datetime import timedelta
from torchft.coordination import LighthouseClient

env = {k: os.environ.get(k) for k in ("RANK", "JDP_RESTART_COUNT", "JDP_REPLICA_GROUP",
       "JDP_REPLICA_GROUPS", "JDP_FT_LIGHTHOUSE", "JDP_FT_EVENTS")}
client = LighthouseClient(env["JDP_FT_LIGHTHOUSE"], connect_timeout=timedelta(seconds=5))
client.heartbeat(f"group{env['JDP_REPLICA_GROUP']}-rank{env['RANK']}")
print("RESULT " + json.dumps(env), flush=True)
restart, now = int(env["JDP_RESTART_COUNT"]), time.time()
events = [{"event": "join", "group": 0, "restart": restart, "time": now}]
if restart == 0 and os.environ.get("FAIL_ONCE"):
    events.append({"event": "discard", "step": 1, "groups": [0, 1], "seconds": 0.25,
                   "time": now, "error": "peer lost"})
else:
    events += [{"event": "commit", "step": s, "groups": g, "seconds": 0.25,
                "time": now + s} for s, g in ((1, [0, 1]), (2, [0]), (3, [0]))]
if env["RANK"] == "0":
    with open(env["JDP_FT_EVENTS"], "a") as f:
        f.write("".join(json.dumps(e) + "\\n" for e in events))
if restart == 0 and os.environ.get("FAIL_ONCE"):
    sys.exit(1)
"""


def results(stdout: str) -> list:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in stdout.splitlines()
            if "RESULT " in line]


def run_group(tmp_path, tag, *args, **env):
    script = write_script(tmp_path, "rank.py", RANK)
    proc = start_launcher([*args, script], job_env(tag, **env))
    out, err = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, out, err


def test_the_launcher_starts_the_lighthouse_and_every_rank_reaches_it(tmp_path, tag):
    pytest.importorskip("torchft")
    port, logdir = free_port(), tmp_path / "logs"
    code, out, err = run_group(tmp_path, tag, "--nproc_per_node", 2, "--replica_group", 1,
                               "--replica_groups", 2, "--ft_lighthouse", f"start:{port}",
                               "--logdir", logdir)
    assert code == 0, err
    address = re.search(r"jdp\.launch: torchft Lighthouse at (http://\S+)", err).group(1)
    assert address.endswith(f":{port}")
    events = str(logdir / "ft_events.jsonl")
    assert sorted(results(out), key=lambda r: r["RANK"]) == [
        {"RANK": str(rank), "JDP_RESTART_COUNT": "0", "JDP_REPLICA_GROUP": "1",
         "JDP_REPLICA_GROUPS": "2", "JDP_FT_LIGHTHOUSE": address, "JDP_FT_EVENTS": events}
        for rank in (0, 1)]
    ft = json.loads((logdir / "summary.json").read_text())["ft"]
    assert ft == {"group": 1, "groups": 2, "committed": 3, "discarded": 0, "discarded_s": 0.0,
                  "fewer_groups_steps": 2, "quorums": [[1, 1, [0, 1]], [2, 3, [0]]],
                  "failures": [{"step": 2, "stall_s": 0.75, "groups_after": [0]}],
                  "downtimes": [], "heals": []}
    assert ("jdp.launch: ft group 1 of 2: 3 steps committed (2 with fewer groups), 0 discarded, "
            "0 heals, stalls 0.8 s") in err


def test_the_lighthouse_outlives_a_restart_of_the_ranks(tmp_path, tag):
    pytest.importorskip("torchft")
    port = free_port()
    code, out, err = run_group(tmp_path, tag, "--replica_group", 0, "--replica_groups", 3,
                               "--ft_lighthouse", f"start:{port}", "--max_restarts", 1,
                               FAIL_ONCE="1")
    assert code == 0, err
    assert err.count("torchft Lighthouse at") == 1, err
    rounds = results(out)
    assert [r["JDP_RESTART_COUNT"] for r in rounds] == ["0", "1"]
    assert rounds[0]["JDP_FT_LIGHTHOUSE"] == rounds[1]["JDP_FT_LIGHTHOUSE"]   # heartbeat twice
    assert rounds[0]["JDP_FT_EVENTS"] == rounds[1]["JDP_FT_EVENTS"]
    assert not os.path.exists(rounds[0]["JDP_FT_EVENTS"])   # the launcher's workdir, removed
    # Both rounds' events, appended: round 0 discarded step 1, then the group restarted (its
    # downtime, from its join to its first commit: 1 s, not a stall), round 1 committed steps
    # 1-3 (all with fewer than 3 groups), dropping group 1 at step 2: 2 - 0.25 - 1 = 0.75 s.
    line = next(x for x in err.splitlines() if x.startswith("jdp.launch: ft group"))
    assert line == ("jdp.launch: ft group 0 of 3: 3 steps committed (3 with fewer groups), "
                    "1 discarded, 0 heals, down 1.0 s in 1 restart, stalls 0.8 s"), line


THREE = """
import json, os
import jax
import jdp

jdp.initialize()
total = jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")(
    jax.numpy.ones(jax.local_device_count()) * (1 + jax.process_index()))
print("RESULT " + json.dumps({"group": os.environ["JDP_REPLICA_GROUP"],
      "port": os.environ["MASTER_PORT"], "count": jax.process_count(),
      "total": float(total[0])}), flush=True)
jdp.shutdown()
"""


def test_three_launchers_on_one_machine_each_run_their_own_coordinator(tmp_path, tag):
    script = write_script(tmp_path, "three.py", THREE)
    with socket.socket() as lighthouse:   # the launchers check that something answers there
        lighthouse.bind(("127.0.0.1", 0))
        lighthouse.listen()
        address = f"http://127.0.0.1:{lighthouse.getsockname()[1]}"
        env = job_env(tag, JDP_FT_LIGHTHOUSE=address)
        procs = [start_launcher(["--nproc_per_node", 2, "--replica_group", g,
                                 "--replica_groups", 3, script], env)
                 for g in range(3)]   # all at once
        done = [p.communicate(timeout=TIMEOUT) for p in procs]
    for p, (_, err) in zip(procs, done, strict=True):
        assert p.returncode == 0, err
    found = [results(out) for out, _ in done]
    ports = set()
    for g, rows in enumerate(found):
        assert len(rows) == 2 and {r["group"] for r in rows} == {str(g)}
        assert all(r["count"] == 2 and r["total"] == 3.0 for r in rows)   # 1 + 2: its own job
        assert len({r["port"] for r in rows}) == 1
        ports.add(rows[0]["port"])
    assert len(ports) == 3, ports
