"""Which job writes into a checkpoint directory: a marker file naming its writer.

Two jobs saving into one directory would interleave their steps and delete each other's
checkpoints. Process 0 of the writing job records itself (host, pid, process start time) in
`.jdp-writer` before each save. A save refuses when the marker names another writer that
still runs on this host, or another writer that took the directory over after this
Checkpointer's last save (the case seen from a second host). A writer that is gone (a job
restarted after a crash or preemption) is simply replaced.
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

MARKER = ".jdp-writer"


def claim(root: Any, directory: str, claimed_before: bool) -> None:
    """Write this process into the marker, or raise RuntimeError naming the other writer."""
    path, mine = root / MARKER, _me()
    try:
        theirs = json.loads(path.read_text())
    except (OSError, ValueError):
        theirs = None
    if isinstance(theirs, dict) and _who(theirs) != _who(mine):
        other = (f"pid {theirs.get('pid')} on host {theirs.get('host')}, saving since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(theirs.get('time', 0)))}")
        if claimed_before:
            raise RuntimeError(f"Checkpointer.save: another job ({other}) took over the "
                               f"checkpoint directory {directory} after this job's last save: "
                               "two jobs are saving into one directory; give each its own")
        if theirs.get("host") == mine["host"] and _alive(theirs.get("pid"), theirs.get("start")):
            raise RuntimeError(f"Checkpointer.save: another job ({other}) is saving into "
                               f"{directory}; give each job its own checkpoint directory, or "
                               "stop that job first")
    if not isinstance(theirs, dict) or _who(theirs) != _who(mine):
        path.write_text(json.dumps(mine))


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid()),
            "time": time.time()}


def _who(marker: dict) -> tuple:
    return marker.get("host"), marker.get("pid"), marker.get("start")


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: Any, start: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = _start_time(pid)
    return start is None or now is None or now == start
