"""The launcher's scratch directories, which a SIGKILL would otherwise leave behind.

A launcher keeps a few directories in the system's temporary directory for one job: the
ranks' progress slots (`watch`), the compilation cache when no `--logdir` keeps one
(`compilation-cache`, as large as the job's compiled programs), the replica groups' events
(`ft`), `jdp.spawn`'s payload (`spawn`). It removes them when it ends, but a launcher killed
by SIGKILL (the OOM killer, a scheduler's hard stop, a test's lost node) runs no clean-up. So
each one is named for its owner, `jdp-KIND-HOST-PID-XXXXXXXX`, and every launcher first
removes those of launchers on its host that are gone (no process PID). A directory of another
host (a /tmp shared between machines), of another user, or whose PID is alive is never
touched; a reused PID only keeps a stale directory longer.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator


def made(kind: str) -> str:
    """A new directory for `kind`, after removing the stale ones (`sweep`); the caller
    removes it."""
    sweep(kind)
    return tempfile.mkdtemp(prefix=_prefix(kind, os.getpid()))


@contextlib.contextmanager
def held(kind: str) -> Iterator[str]:
    """`made(kind)`, removed on the way out."""
    path = made(kind)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def sweep(kind: str, root: str | None = None) -> list:
    """Remove the `kind` directories under `root` (default: the temporary directory) that a
    launcher of this host which is gone left; returns their paths."""
    root = root or tempfile.gettempdir()
    start = f"jdp-{kind}-{_host()}-"
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            if entry.name.startswith(start) and _stale(entry, start):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


def _stale(entry: os.DirEntry, start: str) -> bool:
    pid, dash, _ = entry.name[len(start):].partition("-")
    if not (dash and pid.isdigit()) or int(pid) == os.getpid():
        return False
    try:
        if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
            return False
    except OSError:
        return False
    return not _alive(int(pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process: alive
        return True
    return True


def _prefix(kind: str, pid: int) -> str:
    return f"jdp-{kind}-{_host()}-{pid}-"


def _host() -> str:
    """This host's name with '-' as '_' (the name's fields are split on '-')."""
    return socket.gethostname().replace("-", "_").replace(os.sep, "_") or "host"
