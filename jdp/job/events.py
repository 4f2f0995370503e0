"""A JSON-lines events file: appended by a rank, read back by its launcher (and by tests and
benchmarks replaying a run). Standard library only.

Replica groups (`jdp.ft`) append their joins, commits, discards, heals and serves to the file
named by `JDP_FT_EVENTS`; the launcher reads it into summary.json's "ft" section. One
`os.write` per line on a file opened for appending, so a line is whole or absent even when
the process is killed; a reader skips a line that does not parse all the same.
"""
from __future__ import annotations

import json
import os
import time


def append(path: str, event: str, **fields) -> None:
    """Append `{"event": event, **fields, "time": time.time()}` as one line to `path`."""
    line = json.dumps({"event": event, **fields, "time": time.time()}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read(path: str | None) -> list:
    """The events (dicts) in the file at `path`, in the order written; [] when there is no
    file. A line that is not a JSON object is skipped."""
    if not path or not os.path.exists(path):
        return []
    events = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
    return events
