"""How a round of ranks ended, as one tagged type, and the one text that reports it.

A supervised round ends in exactly one way (`State`); the detail that goes with it is a
`RankExit`, a `Stall` or a `Stop`, never a mix. `report` turns any outcome into the lines the
launcher prints (and `jdp.spawn` raises), and `exit_status` into the launcher's exit status.
"""
from __future__ import annotations

import enum
import signal
from typing import NamedTuple

from jdp.job import env as _env
from jdp.job import watchdog as _watchdog

EXIT_STALLED = 124   # the progress watchdog stopped the job (as coreutils' `timeout`)
_STACK_LINES = 40    # lines of one rank's stack dump in a report


class State(enum.Enum):
    """How a round ended."""
    SUCCEEDED = "succeeded"   # every rank exited 0
    FAILED = "failed"         # a rank exited non-zero or died by a signal (detail: RankExit)
    STALLED = "stalled"       # no rank made progress for the progress timeout (detail: Stall)
    SIGNALED = "signaled"     # the supervisor received SIGINT/SIGTERM (detail: Stop)
    STOPPED = "stopped"       # stopped on request: another node ended the round
    TIMED_OUT = "timed out"   # the round outlived its time limit


class RankExit(NamedTuple):
    """The first rank to fail: its Popen return code (negative: killed by that signal)."""
    rank: int
    returncode: int
    tail: tuple          # the last lines of its stderr


class Stall(NamedTuple):
    """What the watchdog saw: every rank's RankProgress, and rank -> stack dump; `finished`
    names ranks that finished while peers wait in a later step (no timeout needed then)."""
    progress: list
    stacks: dict
    finished: str = ""


class Stop(NamedTuple):
    """A signal to the supervisor, forwarded to every rank."""
    signal: int
    grace_s: float       # how long the ranks had to leave
    killed: tuple        # ranks still running when the grace period ended
    codes: tuple         # (rank, return code) of every rank


class Outcome(NamedTuple):
    """How a supervised round ended, after `seconds`."""
    state: State
    seconds: float = 0.0
    detail: RankExit | Stall | Stop | None = None


class Job(NamedTuple):
    """Who speaks and about what, for the reports."""
    who: str                      # "jdp.launch" or "jdp.spawn"
    world: int                    # processes in the job
    nnodes: int = 1
    node: int = 0                 # the node the outcome comes from
    progress_timeout_s: float | None = None


def exit_status(outcome: Outcome) -> int:
    """The launcher's exit status: 0, the failed rank's status, 124 (stall, time limit),
    or 128+N after signal N."""
    detail = outcome.detail
    if outcome.state is State.FAILED:
        return shell_status(detail.returncode)
    if outcome.state is State.SIGNALED:
        return 128 + detail.signal
    return EXIT_STALLED if outcome.state in (State.STALLED, State.TIMED_OUT) else 0


def shell_status(returncode: int) -> int:
    """A shell-style exit status from a Popen return code: the code, or 128+N for signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'signal SIGKILL (exit status 137)', from a Popen return code."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = str(-returncode)
    return f"signal {name} (exit status {shell_status(returncode)})"


def report(outcome: Outcome, job: Job) -> str:
    """The lines that say how a round ended (empty for success or a requested stop)."""
    who, d = job.who, outcome.detail
    everyone = f"all {job.world} processes" + (f" on {job.nnodes} nodes" if job.nnodes > 1 else "")
    if outcome.state is State.FAILED:
        where = f" on node {job.node}" if job.nnodes > 1 else f" of {job.world}"
        lines = [f"{who}: rank {d.rank}{where} failed with {describe_exit(d.returncode)} after "
                 f"{outcome.seconds:.1f} s; stopped {everyone}."]
        lines.append(f"{who}: last {len(d.tail)} line(s) of rank {d.rank}'s stderr:" if d.tail
                     else f"{who}: rank {d.rank} wrote nothing to stderr.")
        return "\n".join(lines + [f"  {line}" for line in d.tail])
    if outcome.state is State.STALLED:
        return (f"{_stalled(d, who, job.progress_timeout_s)}\n{who}: stopped {everyone} after "
                f"{outcome.seconds:.1f} s (exit status {EXIT_STALLED}).")
    if outcome.state is State.SIGNALED:
        return _stopped(d, who + (f" (node {job.node})" if job.nnodes > 1 else ""))
    if outcome.state is State.TIMED_OUT:
        return f"{who}: processes still running after the time limit; stopped {everyone}."
    return ""


def _stalled(stall: Stall, who: str, timeout_s: float) -> str:
    """Who is behind, their stacks (the first few), where the rest went."""
    never = all(p.phase == "start" for p in stall.progress)   # the start-up limit fired
    lines = [f"{who}: {stall.finished}: the step they wait in can never complete."
             if stall.finished else f"{who}: no rank made progress since it started "
             f"(--progress_timeout {timeout_s:g} s; start-up gets at most "
             f"{_env.STARTUP_TIMEOUT}, default {_watchdog.STARTUP_S:g} s): "
             f"{_watchdog.describe(stall.progress)}." if never else
             f"{who}: no rank made progress for {timeout_s:g} s "
             f"(--progress_timeout): {_watchdog.describe(stall.progress)}."]
    for rank in sorted(stall.stacks)[:_watchdog.MAX_STACKS]:
        dump = stall.stacks[rank].rstrip("\n").splitlines()
        lines.append(f"{who}: Python stack of rank {rank}:")
        lines += [f"  {line}" for line in dump[:_STACK_LINES]]
        if len(dump) > _STACK_LINES:
            lines.append(f"  ... {len(dump) - _STACK_LINES} more line(s)")
    return "\n".join(lines)


def _stopped(stop: Stop, who: str) -> str:
    """After SIGINT/SIGTERM to the supervisor: how each rank ended, or who was killed."""
    name = signal.Signals(stop.signal).name
    if stop.killed:
        return (f"{who}: received {name}; passed it on; rank(s) "
                f"{', '.join(map(str, stop.killed))} still ran {stop.grace_s:g} s later and "
                "were killed (--stop_grace).")
    ended = ", ".join(f"rank {rank} {describe_exit(code)}" for rank, code in stop.codes
                      if code is not None)
    return (f"{who}: received {name}; passed it on; all {len(stop.codes)} process(es) have "
            f"stopped ({ended}).")


def round_line(r: int, previous: dict, members: dict, restarts: int, max_restarts: int,
               planned: bool) -> str:
    """The one line every launcher prints when round r starts: who was lost or joined (by
    --node_rank and host), the new size, and which restart it is.

    `previous` and `members` map --node_rank to a value with `host` and `nproc`, for the nodes
    of round r-1 and of round r.
    """
    world, n = sum(m.nproc for m in members.values()), len(members)
    lost = [f"node {k} ({m.host})" for k, m in previous.items() if k not in members]
    joined = [f"node {k} ({m.host})" for k, m in members.items() if k not in previous]
    budget = ("a planned restart, not counted in --max_restarts" if planned
              else f"restart {restarts} of {max_restarts}")
    if not lost and not joined:
        nodes = f" of {n} nodes" if n > 1 else ""
        if planned:
            return f"jdp.launch: round {r} ({budget}): starting all {world} processes{nodes} again."
        return f"jdp.launch: {budget}: starting all {world} processes{nodes} again."
    changes = ([f"lost {', '.join(lost)}"] if lost else []) + (
        [f"{', '.join(joined)} joined"] if joined else [])
    moved = [f"node {k} is NODE_RANK {d}" for d, k in enumerate(members) if d != k]
    return (f"jdp.launch: round {r} ({budget}): {'; '.join(changes)}; going on with {n} "
            f"node(s), {world} processes{' (' + ', '.join(moved) + ')' if moved else ''}, "
            "from the script's latest checkpoint.")
