"""How the parent drives benchmark processes: request files in a control directory.

Each benchmark configuration (1, 2, 4, 8 devices in one process; a 2-process jdp.launch job; a
2-process torchrun job) lives in its own processes for the whole run: it builds and compiles
its steps once, writes `ready`, then waits, idle, for requests. The parent writes request k as
`req.k` (JSON); every rank of the job runs it (all ranks must, since the steps all-reduce);
rank 0 answers in `res.k`. This lets the parent interleave configurations that cannot share a
process, round after round, without paying start-up and compilation each time.

Files are written to a temporary name and renamed, so a reader never sees half a file. Waiting
ranks poll every few milliseconds: negligible load next to a measurement.

No jax or torch here: both kinds of worker import this module.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

POLL_S = 0.005


def write_json(path: str, obj) -> None:
    """Write JSON atomically (temporary file + rename)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _wait_for(path: str, timeout: float, alive: Callable[[], bool] = lambda: True) -> dict:
    """Poll for a JSON file; raise TimeoutError, or RuntimeError if `alive()` turns False."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if not alive():
            raise RuntimeError(f"benchmark process exited before writing {path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout:.0f} s")
        time.sleep(POLL_S)
    with open(path) as f:
        return json.load(f)


def timed(run: Callable[[], None], steps: int, global_batch: int) -> dict:
    """Run `run()` (which runs `steps` steps) and measure it: wall seconds, samples, and per
    step this process's minor page faults and user / system CPU milliseconds."""
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds": seconds, "samples": global_batch * steps,
            "faults_per_step": (after.ru_minflt - before.ru_minflt) / steps,
            "user_ms_per_step": (after.ru_utime - before.ru_utime) * 1e3 / steps,
            "sys_ms_per_step": (after.ru_stime - before.ru_stime) * 1e3 / steps}


def serve(control: str, handlers: Mapping[str, Callable[[dict], dict]], primary: bool,
          info: dict) -> None:
    """The worker side: announce `info` in `ready`, then answer requests until "stop".

    `handlers[request["op"]](request)` runs on every rank; the primary rank writes its
    result (or the error) as the answer. Returns after a {"op": "stop"} request.
    """
    if primary:
        write_json(os.path.join(control, "ready"), info)
    k = 0
    while True:
        request = _wait_for(os.path.join(control, f"req.{k}"), timeout=float("inf"))
        if request["op"] == "stop":
            return
        try:
            result = handlers[request["op"]](request)
        except Exception as e:  # reported to the parent, which shows it in the report
            result = {"error": f"{type(e).__name__}: {e}"}
            if not primary:
                raise
        if primary:
            write_json(os.path.join(control, f"res.{k}"), result)
        k += 1


class Worker:
    """The parent side: one benchmark job (one or several processes) and its requests."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], control: str,
                 cwd: str):
        """Start `argv` (whose workers serve `control`) with its output in `control`/log."""
        self.name, self.control, self.k = name, control, 0
        os.makedirs(control, exist_ok=True)
        self.log = open(os.path.join(control, "log"), "w")
        self.proc = subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.info: dict = {}

    def alive(self) -> bool:
        """Whether the job's first process still runs."""
        return self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        """The end of the job's combined output, for error messages."""
        self.log.flush()
        with open(os.path.join(self.control, "log"), errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def wait_ready(self, timeout: float) -> dict:
        """Block until the job has compiled its steps; returns what it announced."""
        try:
            self.info = _wait_for(os.path.join(self.control, "ready"), timeout, self.alive)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{self.name}: {e}\n{self.log_tail()}") from None
        return self.info

    def request(self, timeout: float = 300.0, **request) -> dict:
        """Send one request to every rank and wait for rank 0's answer."""
        write_json(os.path.join(self.control, f"req.{self.k}"), request)
        try:
            result = _wait_for(os.path.join(self.control, f"res.{self.k}"), timeout, self.alive)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{self.name}: {e}\n{self.log_tail()}") from None
        self.k += 1
        if "error" in result:
            raise RuntimeError(f"{self.name}: {request} failed: {result['error']}")
        return result

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the job to finish; then SIGTERM (a launcher passes it on to its ranks), then
        SIGKILL to the process group this class started, if it still does not."""
        if self.alive():
            write_json(os.path.join(self.control, f"req.{self.k}"), {"op": "stop"})
        for ask in (None, self.proc.terminate, lambda: os.killpg(self.proc.pid, signal.SIGKILL)):
            if ask is not None and self.alive():
                ask()
            try:
                self.proc.wait(timeout)
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()
