"""The launcher's command line: `python -m jdp.launch` / `jdp-launch`.

Its help text below is the manual; docs/launch.md and docs/faults.md tell the longer story.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
from collections.abc import Sequence

from jdp.job import env as _env
from jdp.job import net as _net
from jdp.job import values
from jdp.job.outcome import Job, Outcome
from jdp.launch import (
    _ft,
    _ft_opts,
    _goodput,
    _profile_opts,
    _rounds,
    _scratch,
    _supervisor,
)
from jdp.launch._config import LaunchConfig

WHO = "jdp.launch"

DESCRIPTION = """\
Start N processes of a training script on this node, one per GPU (or per group of simulated
CPU devices), and watch them.

  python -m jdp.launch --nproc_per_node 4 train.py --epochs 3
  jdp-launch --nnodes 2 --node_rank 0 --master_addr 10.0.0.1 --master_port 29500 \\
             --nproc_per_node 8 train.py            # and --node_rank 1 on the second node

The script calls jdp.initialize(), which reads the variables below.
"""

EPILOG = """\
environment of each process:
  RANK               global rank: NODE_RANK * nproc_per_node + LOCAL_RANK
  LOCAL_RANK         rank on this node, 0..nproc_per_node-1 (jdp.initialize binds the process
                     to GPU LOCAL_RANK when LOCAL_WORLD_SIZE > 1)
  WORLD_SIZE         JDP_NNODES * nproc_per_node
  LOCAL_WORLD_SIZE   nproc_per_node
  NODE_RANK          --node_rank (elastic: this node's index among the round's nodes)
  JDP_NNODES         --nnodes (elastic: the nodes of this round)
  MASTER_ADDR        --master_addr: where process 0 runs its coordinator
  MASTER_PORT        --master_port, or a free port chosen here (fresh each round) on one node
  JDP_RESTART_COUNT  the round: 0 on the first, then 1, 2, ... for every round after
  PYTHONUNBUFFERED   1, so output arrives line by line
  XLA_FLAGS          with --devices_per_process k: --xla_force_host_platform_device_count=k
                     (and JDP_DEVICES_PER_PROCESS=k: a script that replaces XLA_FLAGS is warned)
  JAX_COMPILATION_CACHE_DIR  shared by all processes, so a restart loads its compiled steps:
                     DIR/compilation_cache with --logdir DIR, else a temporary directory
                     removed at exit; set it yourself to keep one, or --compilation_cache off
  JDP_REPLICA_GROUP, JDP_REPLICA_GROUPS, JDP_FT_LIGHTHOUSE, JDP_FT_EVENTS
                     with --replica_groups: see 'replica groups' below
  jdp.initialize also reads JDP_INIT_TIMEOUT (60), JDP_HEARTBEAT_TIMEOUT (30) and
  JDP_SHUTDOWN_TIMEOUT (300) seconds from the environment you launch with.

output: each line a process writes is printed here prefixed with its rank ("[rank1]: ...");
  with --logdir DIR also in DIR/rank.K/stdout and stderr (restarts append), and with
  --redirect_stdout_and_stderr only there.

failures: when a process exits non-zero or dies by a signal, every process of the job is
  stopped at once (SIGTERM, SIGKILL 3 s later); the launcher names the rank, its exit code or
  signal and the last 20 lines of its stderr, and exits with that rank's status (128+N for
  signal N). Every process also dies if the launcher is killed (Linux).

rounds (--max_restarts K, --nnodes M): a job runs in rounds; after a failure all processes
  of every node start again together, up to K times (never after a rank's exit status 78,
  a failure no restart can mend, e.g. replica groups whose set-ups differ). Node 0's
  launcher keeps the rounds (on --rdzv_port when M > 1); every launcher prints the same
  summary of a round's first failure. A launcher that vanishes counts as a failure of its
  node; the next round waits (up to 300 s) for a launcher of that node to connect.

elastic (--nnodes MIN:MAX, --rdzv_timeout S): a round starts when MAX nodes are there, or with
  the nodes there once at least MIN are and S seconds (default 30) have passed. A lost node (its
  launcher gone) does not end the job: the next round goes on with the others, nodes and ranks
  numbered densely (node 0, which runs the coordinator, stays node 0); each such round uses one
  of --max_restarts. A launcher started during a round joins at the next one: every rank gets
  SIGTERM, a loop that asks jdp.preempted() saves and leaves at one step, and the job goes on
  with the new node (a planned restart, not counted in --max_restarts). Node 0 lost: every
  other launcher exits 1 saying so; start the job again. --node_rank names a node for the whole
  job (0..MAX-1; node 0 on the --master_addr machine).

stuck ranks (--progress_timeout S, or JDP_PROGRESS_TIMEOUT=S): jdp's steps, Loader and
  Checkpointer record each rank's progress; once any rank recorded some, S seconds without
  progress on every rank stop the job: the ranks behind are named with their Python stacks,
  and the launcher exits 124 (after the restarts, like any failure). A rank that finished
  while a peer waits in a later step is named at once ("rank 0 finished at step 3; rank 1
  waits in step 4") and the job stops the same way.

goodput: at the end (and before a restart) one line says where the wall time went (start-up
  and compilation, steps, data, eval, checkpoints, lost work, other) and names stragglers,
  ranks that reach each step late (also warned while running, at most once a minute); with
  --logdir DIR also DIR/summary.json (on node 0: the whole job's, merged from every node's)
  and DIR/goodput (TensorBoard). See docs/watching.md.

stop requests (preemption): SIGTERM to the launcher is forwarded to every rank; a loop that
  asks jdp.preempted() sees it at the same step on every rank, saves and leaves. Ranks still
  running --stop_grace S later (default 30, or JDP_STOP_GRACE) are killed; the launcher exits
  143 and does not restart. SIGTERM to one rank stops the whole job the same way (exit 0 when
  every rank then exits 0). SIGINT is forwarded, SIGKILL after 3 s.

replica groups (--replica_group G --replica_groups R, --ft_lighthouse): a fault-tolerant job
  of R groups, each its own job started by its own launcher (any --nnodes, --max_restarts);
  across groups torchft's Lighthouse decides each step's quorum, so a group that dies costs
  the others one step. `--ft_lighthouse start` runs the Lighthouse in this launcher for its
  whole life (its ranks' restarts included); the others join it with HOST:PORT. The group's
  process 0 appends its events (commits, discarded steps, heals) to JDP_FT_EVENTS
  (DIR/ft_events.jsonl with --logdir); at the end the launcher prints one line of them and adds
  them to summary.json ("ft"). See docs/faults.md.

exit status: 0 when every process exits 0; the failed rank's status; 124 when the progress
watchdog stopped the job; 128+N after signal N to the launcher; 2 for bad arguments.

CPU nodes: one process with all the node's devices (--nproc_per_node 1 --devices_per_process N)
  is the faster layout on a node of your own: the same step with ~10 % less CPU and no
  cross-process all-reduce; one process per device pays for the transfer and for the ranks
  waiting on each other. See docs/performance.md; --profile_steps shows it in your own job.
"""


# The numeric options, parsed from their text by `jdp.job.values`: (check, its bounds, the fix).
# --node_rank's range depends on --nnodes, checked once both are known.
_WEEK = {"maximum": _env.MAX_SECONDS}
NUMBERS = {
    "nproc_per_node": (values.integer, {"minimum": 1,
                                        "fix": "processes on this node, usually one per GPU"}),
    "node_rank": (values.integer, {"fix": "this node's index, 0..M-1"}),
    "master_port": (values.integer, {"minimum": 1, "maximum": 65535, "fix": "e.g. 29500"}),
    "rdzv_port": (values.integer, {"minimum": 1, "maximum": 65535,
                                   "fix": "or leave it out (MASTER_PORT+1)"}),
    "max_restarts": (values.integer, {"minimum": 0, "fix": "0: no restart"}),
    "devices_per_process": (values.integer, {"minimum": 1, "fix": "e.g. 2"}),
    "rdzv_timeout": (values.seconds, {"zero": True, **_WEEK,
                                      "fix": "every wait has an end; e.g. 30"}),
    "progress_timeout": (values.seconds, {**_WEEK, "fix": "every wait has an end; e.g. 600"}),
    "stop_grace": (values.seconds, {**_WEEK, "fix": "every wait has an end; e.g. 30"}),
}
_NEGATIVE = re.compile(r"-(\d|\.\d|inf|nan)", re.IGNORECASE)   # "-1", "-1:3", "-.5", "-inf"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, knowing which of its options take a value (`valued`): one given as
    `--option -1:3` reaches the option's own check, as `--option=-1:3` would, instead of
    argparse's "expected one argument" (it takes "-1:3" for an option)."""

    def __init__(self, *args, **kwargs):
        self.valued: set = set()
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs):
        if names and names[0].startswith("-") and kwargs.get("action", "store") == "store":
            self.valued.update(names)
        return super().add_argument(*names, **kwargs)

    def parse_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(_negatives_joined(argv, self.valued), namespace)


def _negatives_joined(argv: list, valued: set) -> list:
    """`argv` with `--option VALUE` written `--option=VALUE` where VALUE starts like a negative
    number, up to the script (its own arguments pass as they are)."""
    joined, i = [], 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        if argv[i] in valued and i + 1 < len(argv):
            option, value = argv[i], argv[i + 1]
            joined += [f"{option}={value}"] if _NEGATIVE.match(value) else [option, value]
            i += 2
        else:
            joined.append(argv[i])
            i += 1
    return joined + argv[i:]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; its help text is the launcher's manual."""
    p = _Parser(prog="python -m jdp.launch", description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc_per_node", "--nproc-per-node", default="1", metavar="N",
                   help="processes to start on this node (default 1); usually one per GPU")
    p.add_argument("--nnodes", default="1", metavar="M|MIN:MAX",
                   help="number of nodes (machines) in the job (default 1); MIN:MAX for an\n"
                        "elastic job that goes on with MIN..MAX nodes (see 'elastic' below)")
    p.add_argument("--node_rank", "--node-rank", default="0", metavar="R",
                   help="index of this node, 0..M-1 (default 0); node 0 hosts the coordinator")
    p.add_argument("--master_addr", "--master-addr", default="127.0.0.1", metavar="A",
                   help="address of node 0, where process 0 listens (default 127.0.0.1)")
    p.add_argument("--master_port", "--master-port", default=None, metavar="P",
                   help="coordinator port on node 0; required with --nnodes > 1, chosen free\n"
                        "(and fresh for each restart) when left out on a single node")
    p.add_argument("--rdzv_port", "--rdzv-port", default=None, metavar="P",
                   help="with --nnodes > 1: port of node 0's launcher, which starts and\n"
                        "restarts the rounds of every node (default MASTER_PORT+1)")
    p.add_argument("--rdzv_timeout", "--rdzv-timeout", default=None, metavar="S",
                   help=f"with --nnodes MIN:MAX: how long a round waits for MAX nodes once\n"
                        f"MIN are there (default {_rounds.RDZV_TIMEOUT_S:g})")
    p.add_argument("--logdir", "--log-dir", default=None, metavar="DIR",
                   help="also write each process's output to DIR/rank.K/{stdout,stderr}")
    p.add_argument("--redirect_stdout_and_stderr", action="store_true",
                   help="with --logdir: write output only to the files, not to the console")
    p.add_argument("-m", "--module", action="store_true",
                   help="treat the script as a Python module name, as `python -m` does")
    p.add_argument("--no_python", "--no-python", action="store_true",
                   help="run the script as an executable, without `python -u` in front")
    p.add_argument("--max_restarts", "--max-restarts", default="0", metavar="K",
                   help="after a failure, stop all processes and start all again, up to K times\n"
                        "(default 0); each node restarts its own processes")
    p.add_argument("--progress_timeout", "--progress-timeout", metavar="S",
                   help="stop the job when no rank made progress for S seconds (default off;\n"
                        "env JDP_PROGRESS_TIMEOUT); see 'stuck ranks' below")
    p.add_argument("--stop_grace", "--stop-grace", metavar="S",
                   help="after SIGTERM, seconds the processes get to save and leave\n"
                        "before SIGKILL (default 30; env JDP_STOP_GRACE)")
    p.add_argument("--compilation_cache", "--compilation-cache", default=None, metavar="DIR",
                   help="JAX's persistent compilation cache directory, or 'off'\n"
                        "(default: see 'compilation cache' below)")
    p.add_argument("--devices_per_process", default=None, metavar="k",
                   help="give each process k simulated CPU devices (testing without GPUs)")
    _profile_opts.add_argument(p)
    _ft_opts.add_arguments(p)
    p.add_argument("script", help="the training script (or module with -m, program with\n"
                                  "--no_python)")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="arguments passed on to the script")
    return p


def parse_args(argv: Sequence[str] | None = None) -> LaunchConfig:
    """Parse and check the command line; bad values exit with status 2 before anything starts.
    The checked values, frozen, are what the launcher reads from then on."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if problem := _problem(args) or _values_problem(args) or _ft_opts.problem(args):
        parser.error(problem)
    return LaunchConfig.from_args(args)


def _problem(args: argparse.Namespace) -> str | None:
    """The first thing wrong with the arguments, as a one-line message with the fix."""
    if problem := _numbers_problem(args) or _nodes_problem(args):
        return problem
    if not 0 <= args.node_rank < args.nnodes:
        return (f"--node_rank {args.node_rank} is not in 0..{args.nnodes - 1} (--nnodes "
                f"{args.nnodes}); number the nodes 0..{args.nnodes - 1}")
    problem = _seconds_problem(args, "progress_timeout", _env.PROGRESS_TIMEOUT, None)
    problem = problem or _seconds_problem(args, "stop_grace", _env.STOP_GRACE,
                                          _supervisor.STOP_GRACE_S)
    if problem:
        return problem
    if problem := _profile_opts.problem(args.profile_steps, args.logdir):
        return problem
    if args.redirect_stdout_and_stderr and args.logdir is None:
        return "--redirect_stdout_and_stderr needs --logdir DIR (where the output goes)"
    if args.logdir is not None and os.path.exists(args.logdir) and not os.path.isdir(args.logdir):
        return (f"--logdir {args.logdir!r} is a file, not a directory; pass a directory path "
                "(it is created if missing)")
    if args.nnodes > 1 and args.master_port is None:
        return (f"--master_port is required with --nnodes {args.nnodes}: every node must use "
                "the same port (e.g. --master_port 29500)")
    if not _net.resolves(args.master_addr):
        return (f"--master_addr {args.master_addr!r} does not resolve to an address; give the "
                "IP address or host name of node 0")
    if args.nnodes > 1 and args.rdzv_port is None:
        args.rdzv_port = args.master_port + 1
    return _script_problem(args) or _port_problem(args)


def _numbers_problem(args: argparse.Namespace) -> str | None:
    """Parse the numeric options' text into numbers (`NUMBERS`), in place; the first one
    refused, in `jdp.job.values`' words (`--stop_grace -1: must be ...`)."""
    try:
        for name, (check, limits) in NUMBERS.items():
            if (text := getattr(args, name)) is not None:
                setattr(args, name, values.from_text(check, "", f"--{name}", text, **limits))
    except ValueError as e:
        return str(e)
    return None


def _values_problem(args: argparse.Namespace) -> str | None:
    """Values that parse but cannot work: a JDP_* setting in the environment the ranks inherit,
    one port for two listeners."""
    try:
        _env.check_settings(os.environ)
    except ValueError as e:
        return str(e)
    if args.nnodes > 1 and args.rdzv_port == args.master_port:
        return (f"--rdzv_port {args.rdzv_port} is also --master_port: node 0's launcher and "
                "process 0's coordinator each need their own port; leave --rdzv_port out "
                "(MASTER_PORT+1) or pick another")
    return None


def _nodes_problem(args: argparse.Namespace) -> str | None:
    """Parse --nnodes M or MIN:MAX into args.nnodes (the most nodes) and args.min_nodes (None:
    fixed size), and --rdzv_timeout; a message when they make no sense."""
    text = str(args.nnodes)
    low, colon, high = text.partition(":")
    if not (low.isdigit() and (high.isdigit() or not colon)):
        return (f"--nnodes {text!r} is not a number of nodes M or a range MIN:MAX "
                "(e.g. --nnodes 2 or --nnodes 1:4)")
    args.nnodes, args.min_nodes = int(high or low), int(low) if colon else None
    if args.nnodes < 1 or colon and not 1 <= args.min_nodes <= args.nnodes:
        return f"--nnodes {text}: must be M >= 1 or MIN:MAX with 1 <= MIN <= MAX"
    if args.rdzv_timeout is not None and not colon:
        return (f"--rdzv_timeout {args.rdzv_timeout:g} needs an elastic --nnodes MIN:MAX "
                f"(here --nnodes {text}, a fixed size that waits for every node)")
    if args.rdzv_timeout is None:
        args.rdzv_timeout = _rounds.RDZV_TIMEOUT_S
    return None


def _seconds_problem(args: argparse.Namespace, name: str, env_name: str,
                     default: float | None) -> str | None:
    """Fill in option `name`, when not given, from `env_name` (or `default`); the variable's
    message when it is not a number of seconds (`jdp.job.env.seconds`)."""
    if getattr(args, name) is None:
        try:
            value = _env.seconds(os.environ, env_name)
        except ValueError as e:
            return str(e)
        setattr(args, name, default if value is None else value)
    return None


def _script_problem(args: argparse.Namespace) -> str | None:
    """A missing script or program (modules are checked by Python in each process)."""
    if args.no_python and not args.module and shutil.which(args.script) is None:
        return f"program {args.script!r} is not an executable file or on PATH"
    if args.module or args.no_python or os.path.isfile(args.script):
        return None
    if os.path.isdir(args.script):   # run as `python DIR` runs it: DIR/__main__.py
        return None if os.path.isfile(os.path.join(args.script, "__main__.py")) else (
            f"script {args.script!r} is a directory without __main__.py; pass the script inside "
            "it, or add DIR/__main__.py")
    return (f"script {args.script!r} does not exist (relative to {os.getcwd()}); check the "
            "path, or pass -m for a module")


def _port_problem(args: argparse.Namespace) -> str | None:
    """On node 0 with a given port: is it free? (JAX would crash on a busy one.)"""
    if args.node_rank != 0 or args.master_port is None:
        return None
    problem = _net.port_problem(args.master_addr, args.master_port, what="--master_port")
    if problem is None and args.nnodes > 1:
        problem = _net.port_problem(args.master_addr, args.rdzv_port, what="--rdzv_port")
    return problem.replace("MASTER_ADDR=", "--master_addr ") if problem else None


def command(config: LaunchConfig) -> list:
    """The command line of one process: the script (or program) through jdp's runner."""
    if config.no_python:
        return [sys.executable, _supervisor.RUNNER, "--exec", config.script, *config.script_args]
    target = ["-m", config.script] if config.module else [config.script]
    return [sys.executable, "-u", _supervisor.RUNNER, *target, *config.script_args]


def rank_specs(config: LaunchConfig, port: int, attempt: int,
               extra_env: dict | None = None, place: _rounds.Round | None = None) -> list:
    """One RankSpec per local process, each with its environment built by rank_env; `place`
    is this node's place in the round (default: --node_rank of --nnodes, all present)."""
    place = place or _rounds.Round(config.node_rank, config.nnodes,
                                   config.node_rank * config.nproc_per_node,
                                   config.nnodes * config.nproc_per_node, None, None)
    base = {**os.environ, **(extra_env or {}), _env.NNODES: str(place.nnodes)}
    specs = []
    for local in range(config.nproc_per_node):
        rank = place.first_rank + local
        env = _supervisor.rank_env(
            base, rank=rank, local_rank=local, world_size=place.world,
            local_world_size=config.nproc_per_node, node_rank=place.node_rank,
            master_addr=config.master_addr, master_port=port, restart_count=attempt,
            devices_per_process=config.devices_per_process)
        specs.append(_supervisor.RankSpec(rank, command(config), env))
    return specs


def launch(config: LaunchConfig) -> int:
    """Run the job in rounds (restarts, several nodes: see `_rounds`); return the exit status."""
    job = Job(WHO, config.nnodes * config.nproc_per_node, config.nnodes, config.node_rank,
              config.progress_timeout)
    limits = _supervisor.Limits(stop_grace_s=config.stop_grace,
                                progress_timeout_s=config.progress_timeout)
    with _compilation_cache(config) as cache_env, _ft_opts.running(config, WHO) as groups:
        if groups is None:   # the Lighthouse did not start (said why)
            return 1

        def run_round(r: int, place: _rounds.Round) -> Outcome:
            port = config.master_port or _net.free_port(config.master_addr)   # fresh per round
            output = _supervisor.Output(config.logdir, append=r > 0,
                                        console=not config.redirect_stdout_and_stderr)
            env = {**cache_env, **_profile_opts.rank_env(config.profile_steps, config.logdir),
                   **groups.env}
            return _supervisor.run(rank_specs(config, port, r, env, place), output, limits,
                                   place.stop, ledger, place.drain)

        rdzv = (config.master_addr, config.rdzv_port) if config.nnodes > 1 else None
        ledger = _goodput.Ledger(WHO, config.logdir, config.node_rank)   # where the time went
        _profile_opts.say(WHO, _profile_opts.no_directory(config.profile_steps, config.logdir))
        status = _rounds.run(job, config.max_restarts, rdzv, run_round, config.min_nodes,
                             config.rdzv_timeout, ledger)
        _finish(config, ledger, groups)
        if status == 0:
            _profile_opts.say(WHO, _profile_opts.no_trace(config.profile_steps, config.logdir,
                                                          ledger.steps_run()))
        return status


def _finish(config: LaunchConfig, ledger: _goodput.Ledger, groups: _ft_opts.Groups) -> None:
    """Print (and with --logdir write) the job's summary; with replica groups, its "ft"
    section of the group's events, and their line."""
    if groups.events is None:
        ledger.finish()
        return
    ft = _ft.section(_ft.read_events(groups.events), config.replica_group,
                     config.replica_groups)
    ledger.finish(lambda summary: _ft.amend(summary, ft))
    if ft is not None:
        _ft_opts.say(_ft.line(WHO, ft))


@contextlib.contextmanager
def _compilation_cache(config: LaunchConfig):
    """The environment that turns on JAX's persistent compilation cache for every process
    ({} when the user set JAX_COMPILATION_CACHE_DIR or said --compilation_cache off)."""
    if config.compilation_cache == "off" or _env.COMPILATION_CACHE in os.environ:
        yield {}
        return
    settings = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    chosen = config.compilation_cache or (
        os.path.join(config.logdir, "compilation_cache") if config.logdir else None)
    if chosen:
        yield {_env.COMPILATION_CACHE: os.path.abspath(chosen), **settings}
        return
    with _scratch.held("compilation-cache") as tmp:
        yield {_env.COMPILATION_CACHE: tmp, **settings}


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `python -m jdp.launch` and the `jdp-launch` console script."""
    sys.exit(launch(parse_args(argv)))
