"""The launcher's replica-group options: bad values exit 2 before anything starts, with one
line naming the value and the fix (a Lighthouse address nobody answers at, a --logdir below
a file); good ones become each rank's environment."""
import contextlib
import os
import socket
import sys
import time

import pytest
from conftest import free_port, launch_fails, write_script

# private: the checked options and the ranks' environment have no public name
from jdp.launch import _cli, _ft_opts

GROUPS = ["--replica_group", "0", "--replica_groups", "2"]


@pytest.mark.parametrize("argv, words", [
    (["--replica_group", "1"], ["--replica_group 1 needs --replica_groups R"]),
    (["--replica_groups", "3"], ["--replica_groups 3 needs --replica_group G", "0..2"]),
    (["--replica_group", "3", "--replica_groups", "3"],
     ["--replica_group 3 is not in 0..2", "number the groups 0..2"]),
    (["--replica_group", "-1", "--replica_groups", "2"], ["--replica_group -1 is not in 0..1"]),
    (["--replica_group", "0", "--replica_groups", "0"],
     ["--replica_groups 0: must be an int >= 1"]),
    (["--ft_lighthouse", "start"],
     ["--ft_lighthouse start needs --replica_group G --replica_groups R"]),
    ([*GROUPS, "--ft_lighthouse", "nowhere"],
     ["--ft_lighthouse 'nowhere' is not 'start', 'start:PORT' or 'HOST:PORT'"]),
    ([*GROUPS, "--ft_lighthouse", "start:0"], ["--ft_lighthouse 'start:0' is not", "1..65535"]),
    ([*GROUPS, "--ft_lighthouse", "start:x"], ["--ft_lighthouse 'start:x' is not"]),
    ([*GROUPS, "--ft_lighthouse", "10.0.0.1:70000"], ["'10.0.0.1:70000' is not"]),
    ([*GROUPS, "--ft_lighthouse", "no-such-host.invalid:29510"],
     ["host 'no-such-host.invalid' does not resolve"]),
])
def test_a_bad_replica_group_option_exits_2_naming_it(tmp_path, capsys, monkeypatch, argv,
                                                      words):
    monkeypatch.setenv("JDP_FT_LIGHTHOUSE", "http://127.0.0.1:29510")
    line = launch_fails(tmp_path, capsys, argv)
    for word in words:
        assert word in line, (word, line)


def test_replica_groups_without_a_lighthouse_name_the_option(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("JDP_FT_LIGHTHOUSE", raising=False)
    line = launch_fails(tmp_path, capsys, GROUPS)
    for word in ("--replica_groups 2 needs torchft's Lighthouse", "--ft_lighthouse start",
                 "--ft_lighthouse HOST:PORT", "JDP_FT_LIGHTHOUSE=http://HOST:PORT"):
        assert word in line, (word, line)


def test_an_inherited_lighthouse_that_is_no_address_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JDP_FT_LIGHTHOUSE", "127.0.0.1")
    line = launch_fails(tmp_path, capsys, GROUPS)
    assert "JDP_FT_LIGHTHOUSE='127.0.0.1' is not http://HOST:PORT" in line, line


def test_starting_a_lighthouse_without_torchft_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft.coordination", None)   # as if not installed
    line = launch_fails(tmp_path, capsys, [*GROUPS, "--ft_lighthouse", "start"])
    assert "--ft_lighthouse start: jdp.ft needs torchft: pip install 'jdp[ft]'" in line, line


def test_starting_a_lighthouse_on_a_busy_port_says_to_join_it(tmp_path, capsys):
    pytest.importorskip("torchft")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = launch_fails(tmp_path, capsys, [*GROUPS, "--ft_lighthouse", f"start:{port}"])
    assert f"port {port} is already in use" in line, line
    assert f"--ft_lighthouse HOST:{port}" in line, line


def config(tmp_path, *argv):
    return _cli.parse_args([*argv, write_script(tmp_path, "ok.py", "print('ok')\n")])


@contextlib.contextmanager
def listening(host="127.0.0.1"):
    """A TCP port on `host` that accepts connections (what the launcher checks of a joined
    Lighthouse), for the block."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as server:
        server.bind((host, 0))
        server.listen()
        yield server.getsockname()[1]


@pytest.mark.parametrize("given, checked", [
    ("127.0.0.1:PORT", "http://127.0.0.1:PORT"),
    ("http://localhost:PORT", "http://localhost:PORT"),
    ("[::1]:PORT", "http://[::1]:PORT"),
])
def test_joining_a_lighthouse_gives_every_rank_its_address(tmp_path, given, checked):
    with listening("::1" if "[" in given else "127.0.0.1") as port:
        given, checked = (x.replace("PORT", str(port)) for x in (given, checked))
        c = config(tmp_path, "--replica_group", "1", "--replica_groups", "3",
                   "--nproc_per_node", "2", "--ft_lighthouse", given)
    assert c.ft_lighthouse == checked
    with _ft_opts.running(c, _cli.WHO) as groups:
        envs = [s.env for s in _cli.rank_specs(c, free_port(), 0, groups.env)]
        assert os.path.exists(groups.events)
    for env in envs:
        assert env["JDP_REPLICA_GROUP"] == "1" and env["JDP_REPLICA_GROUPS"] == "3"
        assert env["JDP_FT_LIGHTHOUSE"] == checked
        assert env["JDP_FT_EVENTS"] == groups.events
    assert not os.path.exists(os.path.dirname(groups.events))   # the temporary workdir is gone


def test_the_events_file_lives_in_the_logdir_one_per_node(tmp_path, monkeypatch):
    with listening() as lighthouse:
        monkeypatch.setenv("JDP_FT_LIGHTHOUSE", f"http://127.0.0.1:{lighthouse}")
        (tmp_path / "logs").mkdir()
        (tmp_path / "logs" / "ft_events.jsonl").write_text('{"event": "old job"}\n')
        c = config(tmp_path, *GROUPS, "--logdir", str(tmp_path / "logs"))
        port = str(free_port())
        node1 = config(tmp_path, *GROUPS, "--logdir", str(tmp_path / "logs"), "--nnodes", "2",
                       "--node_rank", "1", "--master_port", port)
    assert c.ft_lighthouse is None    # inherited: passed through as it is
    with _ft_opts.running(c, _cli.WHO) as groups:
        assert groups.events == str(tmp_path / "logs" / "ft_events.jsonl")
        assert groups.env["JDP_FT_LIGHTHOUSE"] == f"http://127.0.0.1:{lighthouse}"
    assert (tmp_path / "logs" / "ft_events.jsonl").read_text() == ""   # a new job's file
    with _ft_opts.running(node1, _cli.WHO) as groups:
        assert groups.events == str(tmp_path / "logs" / "ft_events.node1.jsonl")


def test_no_replica_groups_no_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("JDP_FT_LIGHTHOUSE", "http://127.0.0.1:29600")
    with _ft_opts.running(config(tmp_path), _cli.WHO) as groups:
        assert groups == _ft_opts.NONE


def test_start_runs_a_lighthouse_on_the_default_port_of_jdp_ft(tmp_path, capsys):
    lighthouse = pytest.importorskip("jdp.ft.lighthouse")
    pytest.importorskip("torchft")
    assert _ft_opts.DEFAULT_PORT == lighthouse.DEFAULT_PORT
    assert _ft_opts._checked("start") == f"start:{lighthouse.DEFAULT_PORT}"   # 29510 may be busy
    port = free_port()
    c = config(tmp_path, *GROUPS, "--ft_lighthouse", f"start:{port}")
    with _ft_opts.running(c, _cli.WHO) as groups:
        address = f"http://{socket.gethostname()}:{port}"
        assert groups.env["JDP_FT_LIGHTHOUSE"] == address
        assert f"jdp.launch: torchft Lighthouse at {address}" in capsys.readouterr().err


def test_a_lighthouse_that_cannot_start_is_said_in_one_line(tmp_path, capsys):
    pytest.importorskip("torchft")
    port = free_port()
    c = config(tmp_path, *GROUPS, "--ft_lighthouse", f"start:{port}")   # free when checked
    with socket.socket() as busy:                                        # taken since
        busy.bind(("0.0.0.0", port))
        busy.listen()
        with _ft_opts.running(c, _cli.WHO) as groups:
            assert groups is None
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"jdp.launch: --ft_lighthouse start:{port}: the Lighthouse did not "
                           "start: "), line
    assert "\n" not in line


@pytest.mark.parametrize("inherited", [False, True], ids=["option", "variable"])
def test_a_lighthouse_nobody_answers_at_exits_2_naming_the_address(tmp_path, capsys,
                                                                   monkeypatch, inherited):
    port = free_port()   # nothing listens there
    if inherited:
        monkeypatch.setenv("JDP_FT_LIGHTHOUSE", f"http://127.0.0.1:{port}")
        argv, named = GROUPS, f"JDP_FT_LIGHTHOUSE=http://127.0.0.1:{port}"
    else:
        argv, named = [*GROUPS, "--ft_lighthouse", f"127.0.0.1:{port}"], "--ft_lighthouse"
    began = time.monotonic()
    line = launch_fails(tmp_path, capsys, argv)
    assert time.monotonic() - began < 5.0
    for word in (named, f"no Lighthouse answers at 127.0.0.1:{port}", "start it first"):
        assert word in line, (word, line)


def test_a_logdir_below_a_file_is_refused_before_a_lighthouse_starts(tmp_path, capsys):
    pytest.importorskip("torchft")
    (tmp_path / "plain").write_text("a file\n")
    port = free_port()
    line = launch_fails(tmp_path, capsys, [*GROUPS, "--ft_lighthouse", f"start:{port}",
                                           "--logdir", str(tmp_path / "plain" / "logs")])
    assert f"--logdir {tmp_path / 'plain' / 'logs'}: {tmp_path / 'plain'} is a file" in line
    with socket.socket() as probe:   # no Lighthouse was started on the port
        probe.bind(("0.0.0.0", port))
