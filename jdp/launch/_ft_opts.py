"""The launcher's side of fault-tolerant replica groups: `--replica_group G --replica_groups R`
and `--ft_lighthouse`, their checks, the Lighthouse a launcher keeps, and the ranks'
environment.

Each replica group is its own jdp job, started by its own launcher; across groups torchft's
Lighthouse decides each step's quorum. A launcher given `--ft_lighthouse start` runs the
Lighthouse in its own process for its whole life, so it outlives every restart of the
launcher's ranks (not the launcher itself). The ranks learn their group, the job's number of
groups, the Lighthouse's address and where to write their events (`_ft`) from the environment.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import NamedTuple

from jdp.job import env as _env
from jdp.job import net as _net
from jdp.job import values
from jdp.launch import _scratch

DEFAULT_PORT = 29510   # jdp.ft.lighthouse.DEFAULT_PORT (not imported: see _lighthouse)
EVENTS_FILE = "ft_events.jsonl"
ALIVE_S = 4.0          # how long a joined Lighthouse's address is tried before exit 2 (a
                       # launcher started beside the one that starts it finds it up)


def _lighthouse():
    """jdp.ft.lighthouse, imported only when this launcher starts a Lighthouse: the launcher's
    other modules import the standard library alone, and jdp.ft is torchft's side."""
    from jdp.ft import lighthouse
    return lighthouse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--replica_group G, --replica_groups R, --ft_lighthouse (also with dashes)."""
    p.add_argument("--replica_group", "--replica-group", default=None, metavar="G",
                   help="this launcher's replica group, 0..R-1, of a fault-tolerant job")
    p.add_argument("--replica_groups", "--replica-groups", default=None, metavar="R",
                   help="the fault-tolerant job's number of replica groups (a launcher each)")
    p.add_argument("--ft_lighthouse", "--ft-lighthouse", default=None,
                   metavar="start|start:PORT|HOST:PORT",
                   help=f"torchft's Lighthouse: run one here (port {DEFAULT_PORT}, or PORT), "
                        "or join HOST:PORT")


def problem(args: argparse.Namespace) -> str | None:
    """The first thing wrong with the replica-group options, as a one-line message with the
    fix; None when fine. Sets args.replica_group(s) to ints and args.ft_lighthouse to its
    checked form: "start:PORT", "http://HOST:PORT", or None (the inherited JDP_FT_LIGHTHOUSE,
    or no replica groups)."""
    try:
        _numbers(args)
    except ValueError as e:
        return str(e)
    group, groups, given = args.replica_group, args.replica_groups, args.ft_lighthouse
    if groups is None and group is not None:
        return (f"--replica_group {group} needs --replica_groups R, the job's number of replica "
                f"groups (e.g. --replica_group {group} --replica_groups {max(2, group + 1)})")
    if group is None and groups is not None:
        return (f"--replica_groups {groups} needs --replica_group G, this launcher's group in "
                f"0..{max(groups, 1) - 1} (e.g. --replica_group 0 --replica_groups {groups})")
    if groups is None:
        return (None if given is None else f"--ft_lighthouse {given} needs --replica_group G "
                "--replica_groups R: the Lighthouse serves a job of replica groups")
    if not 0 <= group < groups:
        return (f"--replica_group {group} is not in 0..{groups - 1} (--replica_groups "
                f"{groups}); number the groups 0..{groups - 1}")
    if problem := _logdir_problem(getattr(args, "logdir", None)):
        return problem
    if given is None:
        return _inherited_problem(os.environ.get(_env.FT_LIGHTHOUSE, ""), groups)
    checked = _checked(given)
    if checked.startswith("--"):
        return checked
    args.ft_lighthouse = checked
    if checked.startswith("start:"):
        return _start_problem(given, checked)
    return _dead_problem(f"--ft_lighthouse {given}", checked)


def _numbers(args: argparse.Namespace) -> None:
    """--replica_group and --replica_groups as ints (`jdp.job.values`), in place; the group's
    range depends on the groups, checked after."""
    if args.replica_group is not None:
        args.replica_group = values.from_text(values.integer, "", "--replica_group",
                                              args.replica_group, fix="this group's index")
    if args.replica_groups is not None:
        args.replica_groups = values.from_text(values.integer, "", "--replica_groups",
                                               args.replica_groups, minimum=1,
                                               fix="the job's number of replica groups")


def _checked(given: str) -> str:
    """"start:PORT" or "http://HOST:PORT" from the option's value; a message (starting with
    "--ft_lighthouse") when it is neither."""
    if given == "start":
        return f"start:{DEFAULT_PORT}"
    usage = (f"--ft_lighthouse {given!r} is not 'start', 'start:PORT' or 'HOST:PORT' with a "
             f"port in 1..65535 (e.g. --ft_lighthouse start, or 10.0.0.1:{DEFAULT_PORT})")
    kind, _, port = given.partition(":")
    if kind == "start":
        return f"start:{port}" if port.isdigit() and 0 < int(port) < 65536 else usage
    try:
        host, port = _net.split_host_port(given.removeprefix("http://"))
    except ValueError:
        return usage
    if not _net.resolves(host):
        return (f"--ft_lighthouse {given!r}: host {host!r} does not resolve; give the address "
                "or host name of the machine that runs the Lighthouse")
    return f"http://{_net.join_host_port(host, port)}"


def _inherited_problem(inherited: str, groups: int) -> str | None:
    """With no --ft_lighthouse: the JDP_FT_LIGHTHOUSE the ranks inherit must be an address."""
    if not inherited:
        return (f"--replica_groups {groups} needs torchft's Lighthouse: --ft_lighthouse start "
                f"(run it in this launcher) or --ft_lighthouse HOST:PORT (join one), or set "
                f"{_env.FT_LIGHTHOUSE}=http://HOST:PORT")
    if not inherited.startswith("http://") or _checked(inherited).startswith("--"):
        return (f"{_env.FT_LIGHTHOUSE}={inherited!r} is not http://HOST:PORT; set it to the "
                "Lighthouse's address, or unset it and pass --ft_lighthouse")
    return _dead_problem(f"{_env.FT_LIGHTHOUSE}={inherited}", inherited)


def _dead_problem(named: str, address: str) -> str | None:
    """Does anything listen at the Lighthouse's address? A TCP connection, tried for
    ALIVE_S seconds; else the one line that says so, before any rank starts (its ranks
    would otherwise fail to reach it one by one, restart after restart)."""
    host, port = _net.split_host_port(address.removeprefix("http://"))
    conn = _net.connect(host, port, ALIVE_S)
    if conn is not None:
        conn.close()
        return None
    return (f"{named}: no Lighthouse answers at {_net.join_host_port(host, port)} (nothing "
            f"accepted a connection within {ALIVE_S:g} s); start it first (--ft_lighthouse "
            "start in one group's launcher, or python -m jdp.ft.lighthouse), or give its "
            "address")


def _logdir_problem(logdir: str | None) -> str | None:
    """A --logdir below a regular file cannot hold the group's events: said before a
    Lighthouse starts (the launcher would otherwise fail creating it, the Lighthouse up)."""
    if logdir is None:
        return None
    path = os.path.abspath(logdir)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if os.path.isdir(path):
        return None
    return (f"--logdir {logdir}: {path} is a file, not a directory, so the group's events "
            f"({EVENTS_FILE}) cannot go below it; pass a directory path")


def _start_problem(given: str, checked: str) -> str | None:
    """Can this launcher start a Lighthouse: is torchft there, is the port free?"""
    try:
        _lighthouse().server_class()
    except ImportError as e:
        return f"--ft_lighthouse {given}: {e}"
    port = int(checked.partition(":")[2])
    if _net.port_problem("0.0.0.0", port) is not None:
        return (f"--ft_lighthouse {given}: port {port} is already in use on this machine; "
                f"join the Lighthouse there with --ft_lighthouse HOST:{port}, or start one on "
                "another port with start:PORT")
    return None


class Groups(NamedTuple):
    """A launcher's replica-group settings while it runs: the ranks' environment (group,
    groups, the Lighthouse, the events file) and the events file's path."""
    env: dict
    events: str | None


NONE = Groups({}, None)


@contextlib.contextmanager
def running(config, who: str):
    """For the launcher's whole life: the Lighthouse (with `start`), the events file (under
    --logdir, else a temporary directory), as `Groups`; NONE without replica groups. Yields
    None, having said why in one line, when the Lighthouse does not start."""
    if config.replica_groups is None:
        yield NONE
        return
    with contextlib.ExitStack() as stack:
        address = config.ft_lighthouse or os.environ[_env.FT_LIGHTHOUSE]
        if address.startswith("start:"):
            address = _started(stack, int(address.partition(":")[2]), who)
            if address is None:
                yield None
                return
        events = _events_path(stack, config.logdir, config.node_rank)
        yield Groups({_env.REPLICA_GROUP: str(config.replica_group),
                      _env.REPLICA_GROUPS: str(config.replica_groups),
                      _env.FT_LIGHTHOUSE: address, _env.FT_EVENTS: events}, events)


def _started(stack: contextlib.ExitStack, port: int, who: str) -> str | None:
    """Start the Lighthouse on `port`, shut down when `stack` closes; its address, or None
    after saying why it did not start (a port taken since the check, torchft's own error)."""
    lighthouse = _lighthouse()
    try:
        server = lighthouse.start(port)
    except (ImportError, RuntimeError, OSError) as e:
        say(f"{who}: --ft_lighthouse start:{port}: the Lighthouse did not start: "
             f"{str(e).splitlines()[0]}")
        return None
    stack.callback(server.shutdown)
    address = lighthouse.address(server)
    say(f"{who}: torchft Lighthouse at {address}")
    return address


def say(text: str) -> None:
    """One line to stderr in one write: the Lighthouse's own log lines (torchft's, from its
    threads) must not land inside it."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _events_path(stack: contextlib.ExitStack, logdir: str | None, node: int) -> str:
    """LOGDIR/ft_events.jsonl (ft_events.nodeK.jsonl on node K > 0, as summary.nodeK.json),
    emptied for this job; else in a temporary directory removed when `stack` closes."""
    if logdir is None:
        directory = stack.enter_context(_scratch.held("ft"))
    else:
        directory = logdir
        os.makedirs(directory, exist_ok=True)
    name = EVENTS_FILE if node == 0 else EVENTS_FILE.replace(".jsonl", f".node{node}.jsonl")
    path = os.path.abspath(os.path.join(directory, name))
    open(path, "w").close()
    return path
