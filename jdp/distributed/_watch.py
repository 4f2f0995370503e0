"""The progress watchdog inside the job, for launchers that do not watch (srun, mpirun).

With JDP_PROGRESS_TIMEOUT=S set and no jdp supervisor around, `jdp.initialize()` starts it:

- on every rank a thread publishes what `Progress.record` noted (count, step, phase: the slot
  lives in this process's memory) to JAX's coordination-service key-value store, once a
  period and only when it changed, and waits for the stall key with a timed get that ends
  the period (no polling);
- on process 0 a thread reads every rank's record from the store, once a period, in one
  directory read; once some rank recorded progress, S seconds without progress on any rank
  (or a finished rank leaving a peer in a later step) make it ask every rank for its Python
  stack, print who is behind with those stacks, and end the job: every rank exits with
  status 124.

A rank's own thread takes its stack (`sys._current_frames`), so it shows each frame's source
line even while the main thread is blocked in a collective, a sleep or a loop. No collective
runs: the store is the coordinator's RPC service, which JAX's heartbeats already use.

The period is a twentieth of S, within [EVERY_S, MAX_EVERY_S]: the watchdog's resolution stays
about 5 % of its timeout, and each rank costs the coordinator at most two small requests a
period whatever the number of processes (process 0's read is O(N) bytes a period); the store
holds one progress key per rank (a stack key more per rank behind, after a stall).
"""
from __future__ import annotations

import sys
import threading
import time

from jdp.job import outcome as _outcome
from jdp.job import progress as _progress
from jdp.job import rank as _rank
from jdp.job import run as _run
from jdp.job import watchdog as _watchdog

KEY = "jdp/watch/"
EVERY_S = 0.5
MAX_EVERY_S = 5.0
STACK_WAIT_S = 5.0       # for the ranks' stacks
EXIT_WAIT_S = 5.0        # the most process 0 waits for the others to leave first


def period(timeout_s: float) -> float:
    """Seconds between a rank's publications for a watchdog of `timeout_s` (see above)."""
    return min(MAX_EVERY_S, max(EVERY_S, timeout_s / 20))


def start(client, rank: int, world: int, timeout_s: float) -> None:
    """Start this rank's publisher (and process 0's watcher) as daemon threads."""
    slot = _rank.current().progress.memory_slot()
    main = threading.main_thread()
    every = period(timeout_s)
    threading.Thread(target=_publish, args=(client, rank, slot, main, every), daemon=True,
                     name="jdp-progress").start()
    if rank == 0:
        threading.Thread(target=_watch, args=(client, world, timeout_s, every), daemon=True,
                         name="jdp-watchdog").start()


def _publish(client, rank: int, slot, main: threading.Thread, every: float = EVERY_S) -> None:
    """Publish this rank's progress; on a stall, its stack; on the exit key, leave (124)."""
    seen = None
    try:
        while True:
            count, step, code, _ = _progress.HEAD.unpack_from(slot)
            if (count, step, code) != seen:
                seen = (count, step, code)
                client.key_value_set(f"{KEY}progress/{rank}", f"{count} {step} {code}",
                                     allow_overwrite=True)
            if _wait_for(client, f"{KEY}stall", every):   # the period's wait
                frame = sys._current_frames().get(main.ident)
                text = _watchdog.frame_summary(frame) if frame is not None else "(no stack)"
                client.key_value_set(f"{KEY}stack/{rank}", text, allow_overwrite=True)
                _run.leave_with(_outcome.EXIT_STALLED)
                if rank == 0:   # its watchdog thread reports, and leaves once the others have
                    return
                _wait_for(client, f"{KEY}exit", STACK_WAIT_S + 30.0)   # process 0 reports
                _run.exit_now(_outcome.EXIT_STALLED)
    except Exception:   # the coordination service is gone (the job is ending): stop watching
        return


def _wait_for(client, key: str, seconds: float) -> bool:
    """True once `key` exists, False after `seconds` without it (one timed request)."""
    try:
        client.blocking_key_value_get(key, max(1, int(1000 * seconds)))
        return True
    except Exception as e:
        if "DEADLINE_EXCEEDED" in str(e):
            return False
        raise


def _watch(client, world: int, timeout_s: float, every: float = EVERY_S) -> None:
    """Process 0: read every rank's progress; on a stall, report and end the job."""
    seen: dict = {}
    last_move = None
    try:
        while True:
            time.sleep(every)
            now = time.monotonic()
            for key, value in client.key_value_dir_get(f"{KEY}progress/"):
                rank = int(key.rsplit("/", 1)[1])
                count, step, code = (int(x) for x in value.split())
                if count > 0 and seen.get(rank) != (count, step, code):
                    seen[rank], last_move = (count, step, code), now
            if last_move is None:
                continue
            progress = [_watchdog.RankProgress(r, seen[r][1], _progress.PHASES[seen[r][2]])
                        if r in seen else _watchdog.RankProgress(r, -1, "start")
                        for r in range(world)]
            finished = (_watchdog.finished_early(progress)
                        if now - last_move >= _watchdog.FINISHED_WAIT_S else None)
            if finished or now - last_move >= timeout_s:
                _stop_job(client, progress, timeout_s, finished or "", now - last_move)
    except Exception:   # the coordination service is gone (the job is ending): stop watching
        return


def _stop_job(client, progress: list, timeout_s: float, finished: str, idle: float) -> None:
    """Collect the stacks of the ranks behind, print the report, make every rank exit 124."""
    client.key_value_set(f"{KEY}stall", "1", allow_overwrite=True)
    late = ([p for p in progress if p.phase != "done"] if finished
            else _watchdog.behind(progress))[:_watchdog.MAX_STACKS]
    stacks, deadline = {}, time.monotonic() + STACK_WAIT_S
    for p in late:
        try:
            left = max(1, int(1000 * (deadline - time.monotonic())))
            stacks[p.rank] = client.blocking_key_value_get(f"{KEY}stack/{p.rank}", left)
        except Exception:  # that rank's thread did not answer in time (or is gone)
            stacks[p.rank] = "(no stack: its watchdog thread did not answer)"
    outcome = _outcome.Outcome(_outcome.State.STALLED, idle,
                               _outcome.Stall(progress, stacks, finished))
    text = _outcome.report(outcome, _outcome.Job("jdp", len(progress),
                                                 progress_timeout_s=timeout_s))
    text = text.replace("(--progress_timeout)", "(JDP_PROGRESS_TIMEOUT)")
    text = text.replace(f"after {idle:.1f} s", f"after {idle:.1f} s without progress")
    print(text, file=sys.stderr, flush=True)
    _run.leave_with(_outcome.EXIT_STALLED)
    client.key_value_set(f"{KEY}exit", "1", allow_overwrite=True)
    peers = _rank.current().peers
    if not peers.watched:   # no roll call's connections to tell when the others have left
        time.sleep(EXIT_WAIT_S)
    peers.wait_gone(EXIT_WAIT_S)   # process 0 leaves last, once the others saw the exit key
    _run.exit_now(_outcome.EXIT_STALLED)
