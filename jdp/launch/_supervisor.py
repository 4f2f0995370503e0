"""The one supervise loop behind `jdp.launch` and `jdp.spawn`: one round of one node's ranks.

Every rank is a subprocess in its own session (process group), so a signal to the group
reaches anything the rank started too. A waiter thread per rank reports its exit the moment
it happens (a rank whose collective lost a peer lingers a moment, see `_run.report_failure`),
so the failure reported is the first one, the cause, not its echo in the peers; the loop then
stops every other rank. SIGTERM to the supervisor is a stop request (preemption), forwarded
to every rank, which may save and leave within the stop grace period; SIGINT gets the short
grace. A rank dies with the supervisor even if that is SIGKILLed (`_run.die_with_supervisor`).
"""
from __future__ import annotations

import collections
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, NamedTuple

from jdp.job import env as _env
from jdp.job import malloc as _malloc
from jdp.job import progress as _progress
from jdp.job import run as _run
from jdp.job import watchdog as _watchdog
from jdp.job.outcome import Outcome, RankExit, Stall, State, Stop
from jdp.launch import _goodput, _scratch

RUNNER = os.path.abspath(_run.__file__)  # run by path
GRACE_S = 3.0        # SIGTERM -> SIGKILL after a failure; keeps "all gone" well under 5 s
STOP_GRACE_S = 30.0  # SIGTERM -> SIGKILL after a stop request: time to save a checkpoint
POLL_S = 0.05        # how often the loop looks at signals and deadlines
TAIL_LINES = 20      # lines of the failed rank's stderr in the summary
_HOST_DEVICES = _env.HOST_DEVICES_FLAG
# Lines kept out of the console (they stay in the per-rank log files): gloo's connection
# chatter, one line per gloo context; a process with several devices writes them from several
# threads at once, so fragments of two lines can share one line, or start one.
_CONSOLE_NOISE = re.compile(r"\[Gloo\] Rank|is connected to \d+ peer ranks|"
                            r"Expected number of connected peer ranks")
_console_lock = threading.Lock()


class RankSpec(NamedTuple):
    """How to start one rank: its global rank, command line and full environment."""
    rank: int
    cmd: Sequence[str]
    env: Mapping[str, str]


class Output(NamedTuple):
    """Where ranks' output goes: the console (each line prefixed `[rankK]: `) and/or files."""
    logdir: str | None = None    # DIR/rank.K/stdout and DIR/rank.K/stderr when set
    console: bool = True         # echo to our own stdout/stderr
    append: bool = False         # append to the log files (restarts) instead of truncating


class Limits(NamedTuple):
    """The supervisor's clocks, in seconds (None: no limit)."""
    grace_s: float = GRACE_S                  # after a failure or SIGINT, before SIGKILL
    stop_grace_s: float = STOP_GRACE_S        # after a SIGTERM stop request, before SIGKILL
    timeout_s: float | None = None            # the whole run
    progress_timeout_s: float | None = None   # no rank making progress (the watchdog)


CONSOLE, DEFAULT_LIMITS = Output(), Limits()   # console only; default clocks, no watchdog
_FAILED = (State.FAILED, State.STALLED, State.TIMED_OUT, State.STOPPED)   # rounds lost


class _Rank(NamedTuple):
    spec: RankSpec
    proc: subprocess.Popen
    tail: collections.deque
    threads: list


def rank_env(base: Mapping[str, str], *, rank: int, local_rank: int, world_size: int,
             local_world_size: int, node_rank: int, master_addr: str, master_port: int,
             restart_count: int = 0, devices_per_process: int | None = None) -> dict:
    """One rank's environment: `base` (less one supervisor's internal variables), the
    `_env.RANK_VARS` that `jdp.initialize` reads, PYTHONUNBUFFERED=1, `_malloc.child_env`'s
    settings and, with `devices_per_process` k, --xla_force_host_platform_device_count=k."""
    env = {k: v for k, v in base.items() if k not in _env.INTERNAL_VARS}
    values = (rank, local_rank, world_size, local_world_size, node_rank, master_addr,
              master_port, restart_count)
    env.update({k: str(v) for k, v in zip(_env.RANK_VARS, values, strict=True)})
    env["PYTHONUNBUFFERED"] = "1"
    if devices_per_process is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_HOST_DEVICES)]
        env["XLA_FLAGS"] = " ".join([*flags, f"{_HOST_DEVICES}={devices_per_process}"])
        env[_env.DEVICES_PER_PROCESS] = str(devices_per_process)   # initialize checks XLA_FLAGS
    return _malloc.child_env(env)


def run(specs: Sequence[RankSpec], output: Output = CONSOLE, limits: Limits = DEFAULT_LIMITS,
        stop: threading.Event | None = None, ledger: _goodput.Ledger | None = None,
        drain: threading.Event | None = None) -> Outcome:
    """Start every rank, supervise them to the end, and leave no process behind.

    SIGINT and SIGTERM received meanwhile (main thread only) are forwarded to every rank.

    Args:
        specs: one RankSpec per rank.
        output: where the ranks' stdout/stderr go.
        limits: grace periods, the run's time limit and the progress timeout.
        stop: when set (by another thread), stop every rank and return (State.STOPPED).
        ledger: where the round's time goes (`_goodput`); it also warns of stragglers.
        drain: when set, pass SIGTERM to every rank (a stop request, as below) and return
            State.STOPPED once they left: the launcher's planned restart to take in a node.

    Returns:
        The Outcome: success, or the first failed rank, signal, deadline or stall that ended it.
    """
    received: list = []
    previous = _catch_signals(received)
    ranks: list = []
    start = time.monotonic()
    watched = limits.progress_timeout_s or ledger is not None
    workdir = _scratch.made("watch") if watched else None
    outcome = None
    try:
        events: queue.Queue = queue.Queue()
        slots = {spec.rank: _slot_path(workdir, spec.rank) for spec in specs} if workdir else {}
        if ledger is not None:
            ledger.begin(slots)
        for spec in specs:
            ranks.append(_start(spec, output, events, workdir))
        watchdog = _watchdog.Watchdog(slots, limits.progress_timeout_s,
                                      _env.seconds(os.environ, _env.STARTUP_TIMEOUT)
                                      ) if slots else None
        outcome = _supervise(ranks, events, received, limits, watchdog, start, stop, ledger,
                             drain)
    finally:
        _stop(ranks, signal.SIGTERM, limits.grace_s)
        if ledger is not None:
            ledger.end(failed=outcome is None or outcome.state in _FAILED)
        for s, handler in previous.items():
            signal.signal(s, handler)
        for r in ranks:
            for t in r.threads:
                t.join(timeout=1.0)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    if outcome.state is State.FAILED:   # the pumps are done: the tail is complete
        return outcome._replace(detail=outcome.detail._replace(tail=tuple(outcome.detail.tail)))
    return outcome


def _supervise(ranks: list, events: queue.Queue, received: list, limits: Limits,
               watchdog: _watchdog.Watchdog | None, start: float,
               stop: threading.Event | None, ledger: _goodput.Ledger | None,
               drain: threading.Event | None = None) -> Outcome:
    """The loop: wait for exits; on the first failure, signal, deadline or stall, stop all."""
    running = {r.spec.rank for r in ranks}
    by_rank = {r.spec.rank: r for r in ranks}
    deadline = None if limits.timeout_s is None else start + limits.timeout_s
    next_sample = 0.0
    while running:
        now = time.monotonic()
        if ledger is not None and now >= next_sample:
            next_sample = now + _watchdog.READ_EVERY_S
            if text := ledger.sample(now):
                with _console_lock:
                    print(text, file=sys.stderr, flush=True)
        if received:
            return _stop_requested(ranks, received, limits, now - start)
        if deadline is not None and now > deadline:
            return Outcome(State.TIMED_OUT, now - start)
        if stop is not None and stop.is_set():
            return Outcome(State.STOPPED, now - start)
        if drain is not None and drain.is_set():
            stopped = _stop_requested(ranks, [signal.SIGTERM], limits, now - start)
            return stopped._replace(state=State.STOPPED)
        progress = watchdog.stalled(now) if watchdog is not None else None
        if progress is not None:
            return _stalled(ranks, progress, limits, now - start)
        finished = watchdog.abandoned(now) if watchdog is not None else None
        if finished is not None:
            return _stalled(ranks, watchdog.progress(), limits, now - start, finished)
        try:
            rank, code = events.get(timeout=POLL_S)
        except queue.Empty:
            continue
        running.discard(rank)
        if ledger is not None:
            ledger.exited(rank, time.monotonic())
        if code != 0:
            seconds = time.monotonic() - start
            _stop(ranks, signal.SIGTERM, limits.grace_s)
            failed = by_rank[rank]
            for t in failed.threads:
                t.join(timeout=1.0)   # the rest of its stderr, for the tail
            return Outcome(State.FAILED, seconds, RankExit(rank, code, failed.tail))
    return Outcome(State.SUCCEEDED, time.monotonic() - start)


def _stop_requested(ranks: list, received: list, limits: Limits, seconds: float) -> Outcome:
    """Forward a stop signal to every rank and give them their grace period to leave.

    SIGTERM gets the stop grace (ranks may reach an agreed step and save a checkpoint); SIGINT,
    or a second signal during the grace period, the short one.
    """
    sig = received[0]
    grace = limits.stop_grace_s if sig == signal.SIGTERM else limits.grace_s
    for r in ranks:
        if r.proc.returncode is None:
            _signal_group(r.proc.pid, sig)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and len(received) == 1 and _alive(ranks):
        time.sleep(POLL_S)
    killed = tuple(r.spec.rank for r in _alive(ranks))
    _stop(ranks, sig, limits.grace_s if len(received) > 1 else 0.0)
    codes = tuple((r.spec.rank, r.proc.returncode) for r in ranks)
    return Outcome(State.SIGNALED, seconds, Stop(sig, grace, killed, codes))


def _stalled(ranks: list, progress: list, limits: Limits, seconds: float,
             finished: str = "") -> Outcome:
    """The watchdog fired: collect the stacks of the ranks behind (of those left waiting when
    a rank finished early), then stop every rank."""
    late = ([p for p in progress if p.phase != "done"] if finished
            else _watchdog.behind(progress))[:_watchdog.MAX_STACKS]
    by_rank = {r.spec.rank: r for r in ranks}
    pids = {p.rank: by_rank[p.rank].proc.pid for p in late
            if by_rank[p.rank].proc.returncode is None}
    stacks = _watchdog.dump_stacks(pids, {rank: by_rank[rank].spec.env.get(_env.STACK_FILE, "")
                                          for rank in pids})
    return Outcome(State.STALLED, seconds, Stall(progress, stacks, finished))


def _alive(ranks: list) -> list:
    return [r for r in ranks if r.proc.returncode is None]


def _slot_path(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"progress.{rank}")


def _watch_files(workdir: str | None, rank: int) -> dict:
    """The rank's progress slot (created empty here) and stack-dump file, as env variables."""
    if workdir is None:
        return {}
    slot = _slot_path(workdir, rank)
    with open(slot, "wb") as f:
        f.write(bytes(_progress.SLOT_SIZE))
    return {_env.PROGRESS_FILE: slot,
            _env.STACK_FILE: os.path.join(workdir, f"stacks.{rank}")}


def _start(spec: RankSpec, output: Output, events: queue.Queue, workdir: str | None) -> _Rank:
    """Start one rank in its own session with piped output, plus its pump and waiter threads."""
    files = _open_logs(output, spec.rank)
    env = {**spec.env, **_watch_files(workdir, spec.rank),
           _env.SUPERVISOR_PID: str(os.getpid())}   # run.py: die with us
    spec = spec._replace(env=env)
    proc = subprocess.Popen(list(spec.cmd), env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    prefix = f"[rank{spec.rank}]: "
    threads = [
        threading.Thread(target=_pump, args=(proc.stdout, files[0], output.console, "stdout",
                                             prefix, None), daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, files[1], output.console, "stderr",
                                             prefix, tail), daemon=True),
        threading.Thread(target=lambda: events.put((spec.rank, proc.wait())), daemon=True),
    ]
    for t in threads:
        t.start()
    return _Rank(spec, proc, tail, threads[:2])


def _open_logs(output: Output, rank: int) -> tuple:
    """(stdout file, stderr file) for a rank under output.logdir, or (None, None)."""
    if output.logdir is None:
        return None, None
    directory = os.path.join(output.logdir, f"rank.{rank}")
    os.makedirs(directory, exist_ok=True)
    mode = "a" if output.append else "w"
    return tuple(open(os.path.join(directory, name), mode, encoding="utf-8")
                 for name in ("stdout", "stderr"))


def _pump(pipe: IO[bytes], file: IO[str] | None, console: bool, stream: str, prefix: str,
          tail: collections.deque | None) -> None:
    """Copy a rank's output line by line to its log file and/or our console (prefixed).

    Reads to the end even when a destination fails, so a rank never blocks on a full pipe.
    """
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            line = line if line.endswith("\n") else line + "\n"
            if file is not None:
                file = _write(file, line)
            if _CONSOLE_NOISE.search(line):
                continue
            if tail is not None:
                tail.append(line.rstrip("\n"))
            if console:
                target = sys.stdout if stream == "stdout" else sys.stderr
                with _console_lock:
                    console = _write(target, prefix + line) is not None
    if file is not None:
        file.close()


def _write(target: IO[str], text: str) -> IO[str] | None:
    """Write and flush `text`; None when `target` is closed or broken (stop writing to it)."""
    try:
        target.write(text)
        target.flush()
        return target
    except (OSError, ValueError):
        return None


def _stop(ranks: list, sig: int, grace_s: float) -> None:
    """Send `sig` to every rank's process group; SIGKILL the groups after `grace_s`."""
    for r in ranks:
        if r.proc.returncode is None:
            _signal_group(r.proc.pid, sig)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _alive(ranks):
        time.sleep(0.01)
    for r in ranks:           # also grandchildren that outlived their rank
        _signal_group(r.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and _alive(ranks):
        time.sleep(0.01)


def _signal_group(pid: int, sig: int) -> None:
    """Signal the process group led by `pid` (the rank and everything it started)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _catch_signals(received: list) -> dict:
    """Record SIGINT/SIGTERM in `received` instead of dying; return the handlers they replace."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, lambda signum, frame: received.append(signum))
    return previous
