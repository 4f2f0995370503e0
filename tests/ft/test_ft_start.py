"""When a replica group at step 0 trains, waits or stops (`_start`), what a restarted group
remembers (`_record`, from an events file written here line by line), and where torchft's
own log goes (`torchft_log`: a real torchft checkpoint server asked over HTTP)."""
import json
import logging
import socket
import urllib.request

import pytest

from jdp.ft import _record, _start

ME = _start.Me(group=1, groups=3, min_groups=3, start_timeout=300.0, quorum_timeout=60.0,
               past=0)


def _rows(*groups, step=0, past=(), ready=()):
    return [{"group": g, "step": step, "past": dict(past).get(g, 0), "ready": g in ready}
            for g in groups]


def test_a_fresh_job_starts_with_all_its_groups_and_never_alone():
    assert _start.decide(_rows(0, 1, 2), ME, 1.0) == _start.GO
    assert _start.decide(_rows(0, 1), ME, 299.0) == _start.WAIT
    line = _start.decide(_rows(1), ME, 301.0)
    assert line.startswith("jdp.ft: replica group 1 waited start_timeout=300 s for the job's 3 "
                           "replica groups and found 1 (groups 1)"), line
    assert "min_groups=K" in line and "the job is over" in line


def test_min_groups_starts_every_group_of_the_quorum_once_one_waited_long_enough():
    me = ME._replace(min_groups=2)
    assert _start.decide(_rows(0, 1), me, 10.0) == _start.WAIT
    assert _start.decide(_rows(0, 1, ready=(0,)), me, 10.0) == _start.GO   # group 0 waited
    assert _start.ready(me, 300.0) and not _start.ready(me, 299.9)
    assert "min_groups=2 is not reached" in _start.decide(_rows(1), me, 301.0)
    # enough groups, past start_timeout here, but no row said so yet (this group's flag was
    # written a moment before its timeout): wait for the next poll's rows, never stop
    assert _start.decide(_rows(0, 1), me, 301.0) == _start.WAIT


def test_a_record_of_commits_with_nobody_ahead_stops_rather_than_start_over():
    restarted = ME._replace(past=187)
    for rows in (_rows(1, past={1: 187}), _rows(0, 1, 2, past={1: 187, 2: 190})):
        line = _start.decide(rows, restarted, 0.5)   # alone, or every group here: at once
        assert line.startswith("jdp.ft: no live replica group to heal from: "), line
        assert "restart the job from a checkpoint" in line
    alone = _start.decide(_rows(1, past={1: 187}), restarted, 0.5)
    assert "this group had committed 187 steps" in alone
    assert "replica group 2 had committed 190 steps" in _start.decide(
        _rows(0, 1, 2, past={1: 187, 2: 190}), restarted, 0.5)
    two = _rows(1, 2, past={1: 187})   # a live group may still join within quorum_timeout
    assert _start.decide(two, restarted, 59.0) == _start.WAIT
    assert _start.decide(two, restarted, 61.0).startswith("jdp.ft: no live replica group")
    fresh = _rows(0, 1, past={0: 40})   # a fresh group meeting a restarted one stops too
    assert "replica group 0 had committed 40 steps" in _start.decide(fresh, ME, 61.0)


def test_a_group_ahead_is_a_live_peer_to_heal_from():
    rows = _rows(0, 2, past={0: 900}) + [{"group": 1, "step": 900, "past": 0, "ready": False}]
    assert _start.decide(rows, ME._replace(past=900), 100.0) == _start.WAIT


def test_the_waiting_notice_says_what_the_group_waits_for():
    fresh = _start.waiting(_rows(0, 1), ME)
    assert "waits for the other replica groups to join the job's first step: 2 of 3" in fresh
    rejoining = _start.waiting(_rows(1), ME._replace(past=900))
    assert "first step" not in rejoining
    assert "its record: 900 steps committed" in rejoining and "heal from" in rejoining


def _write(path, *events):
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def test_the_record_is_this_jobs_commits_since_its_first_start(tmp_path):
    path = tmp_path / "events.jsonl"
    _write(path, {"event": "join", "restart": 0}, {"event": "commit", "step": 99},
           {"event": "join", "restart": 0},   # the launcher's next job: the one that counts
           *({"event": "commit", "step": s} for s in range(1, 6)),
           {"event": "heal", "step": 8}, {"event": "join", "restart": 1})
    assert _record.past(str(path), 1) == _record.Past(8, None)
    assert _record.past(str(path), 0) == _record.Past(0, None)   # a first start: fresh
    assert _record.past(None, 2) == _record.Past(0, None)
    with path.open("a") as f:
        f.write(json.dumps({"event": "stop", "reason": "jdp.ft: groups differ"}) + "\n")
        f.write("{truncated\n")
    assert _record.past(str(path), 2) == _record.Past(8, "jdp.ft: groups differ")


def test_torchfts_tracebacks_and_access_log_go_to_the_groups_file(tmp_path, capfd):
    pytest.importorskip("torchft")
    from datetime import timedelta

    from torchft.checkpointing import HTTPTransport

    from jdp.ft import _manager
    path = _manager.torchft_log(str(tmp_path / "ft_events.jsonl"), 0)
    assert path == str(tmp_path / "torchft.0.log")
    try:
        raise ValueError("a failed all-reduce")
    except ValueError:
        logging.getLogger("torchft.manager").exception("got exception in all reduce")
    transport = HTTPTransport(timeout=timedelta(seconds=5), num_chunks=0)
    try:
        _manager._quiet_access_log(type("M", (), {"_checkpoint_transport": transport})())
        transport.send_checkpoint([1], step=3, state_dict={"x": 1}, timeout=timedelta(seconds=5))
        address = transport.metadata().replace(socket.gethostname(), "localhost")
        with urllib.request.urlopen(f"{address}3/full", timeout=5) as answer:
            assert answer.status == 200 and answer.read()
    finally:
        transport.shutdown(wait=False)
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "GET /checkpoint" not in err, err
    text = open(path).read()
    for word in ("got exception in all reduce", "Traceback", "ValueError: a failed all-reduce",
                 "GET /checkpoint/3/full"):
        assert word in text, (word, text)
