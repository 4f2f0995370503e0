"""The group's record of its steps: one JSON object per line, appended by its process 0.

The launcher reads the file at the job's end into summary.json's "ft" section (which steps
committed with which groups, the discarded attempts, the heals); a test replays the run from
it. One `os.write` per line on a file opened for appending, so a line is whole or absent.
"""
from __future__ import annotations

import json
import os
import time


class Events:
    """Appends events to `path` (None: keeps none)."""

    def __init__(self, path: str | None):
        self.path = path

    def write(self, event: str, **fields) -> None:
        if self.path is None:
            return
        line = json.dumps({"event": event, **fields, "time": time.time()}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def read(path: str) -> list:
    """The events in `path`; a last line cut short by a kill is left out."""
    events = []
    with open(path) as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events
