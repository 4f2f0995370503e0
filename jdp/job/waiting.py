"""No silent wait: a wait that may last says what it waits for, soon and then now and then.

A launcher waiting for its nodes, or a process waiting for its peers in `jdp.initialize`, looks
the same as a hung one unless it speaks: `announced` prints a line (who waits, for which nodes
or ranks, at which address, for how long at most) `FIRST_S` seconds into the wait, then at most
once every `EVERY_S`, until the wait ends. The final message (a timeout error) stays the
caller's. Standard library only: the launcher imports it.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator

FIRST_S = 5.0     # well within the 10 s a user waits before wondering
EVERY_S = 60.0


@contextlib.contextmanager
def announced(message: Callable[[float], str | None], first_s: float = FIRST_S,
              every_s: float = EVERY_S) -> Iterator[None]:
    """Run the body; while it runs, print `message(seconds waited)` to stderr after `first_s`
    seconds, then every `every_s` (nothing when it returns None)."""
    done = threading.Event()
    start = time.monotonic()

    def speak() -> None:
        pause = first_s
        while not done.wait(pause):
            try:
                text = message(time.monotonic() - start)
            except RuntimeError:   # the waiter's state changed under us: say it next time
                text = None
            if text and not done.is_set():
                print(text, file=sys.stderr, flush=True)
            pause = every_s

    thread = threading.Thread(target=speak, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1.0)


def seconds(value: float) -> str:
    """A duration as a user reads it: `42 s`."""
    return f"{value:.0f} s"
