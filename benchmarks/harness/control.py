"""Long-lived benchmark jobs driven through request files, timed in interleaved rounds.

Each configuration lives in its own processes for the whole run: it compiles once, writes
`ready`, then serves requests: the parent writes `req.k` (JSON), every rank runs it (the steps
all-reduce), rank 0 answers in `res.k`. Configurations that cannot share a process thus run
interleaved, A B C then C B A, so variants in one round see about the same load on shared cores.
No jax or torch here: both kinds of worker import this.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import time


def write_json(path: str, obj) -> None:
    """Write JSON atomically (temporary file + rename): a reader never sees half a file."""
    with open(f"{path}.tmp{os.getpid()}", "w") as f:
        json.dump(obj, f)
    os.replace(f"{path}.tmp{os.getpid()}", path)


def _wait_for(path: str, timeout: float, alive=lambda: True) -> dict:
    """Poll for a JSON file; TimeoutError, or RuntimeError once `alive()` is False."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if not alive():
            raise RuntimeError(f"benchmark process exited before writing {path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout:.0f} s")
        time.sleep(0.005)
    with open(path) as f:
        return json.load(f)


def timed(run, steps: int, global_batch: int) -> dict:
    """Seconds and samples of `run()` (`steps` steps), and per step this process's minor page
    faults and user / system CPU milliseconds."""
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    run()
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds": seconds, "samples": global_batch * steps,
            "faults_per_step": (after.ru_minflt - before.ru_minflt) / steps,
            "user_ms_per_step": (after.ru_utime - before.ru_utime) * 1e3 / steps,
            "sys_ms_per_step": (after.ru_stime - before.ru_stime) * 1e3 / steps}


def serve(control: str, handlers: dict, primary: bool, info: dict) -> None:
    """The worker side: announce `info`, then run `handlers[request["op"]]` on every rank until
    a "stop" request; the primary rank answers with the result or the error."""
    if primary:
        write_json(os.path.join(control, "ready"), info)
    for k in range(10**9):
        request = _wait_for(os.path.join(control, f"req.{k}"), timeout=float("inf"))
        if request["op"] == "stop":
            return
        try:
            result = handlers[request["op"]](request)
        except Exception as e:  # the parent shows it in the report
            if not primary:
                raise
            result = {"error": f"{type(e).__name__}: {e}"}
        if primary:
            write_json(os.path.join(control, f"res.{k}"), result)


class Worker:
    """The parent side: one benchmark job (one or several processes) and its requests."""

    def __init__(self, name: str, argv: list, env: dict, control: str, cwd: str):
        """Start `argv`, whose ranks serve `control`, logging to `control`/log."""
        self.name, self.control, self.k, self.info = name, control, 0, {}
        os.makedirs(control, exist_ok=True)
        self.log = open(os.path.join(control, "log"), "w")
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def _wait(self, name: str, timeout: float) -> dict:
        """`_wait_for` a file of this job; errors carry the end of the job's log."""
        try:
            return _wait_for(os.path.join(self.control, name), timeout,
                             lambda: self.proc.poll() is None)
        except (RuntimeError, TimeoutError) as e:
            self.log.flush()
            with open(os.path.join(self.control, "log"), errors="replace") as f:
                raise RuntimeError(f"{self.name}: {e}\n{''.join(f.readlines()[-15:])}") from None

    def wait_ready(self, timeout: float) -> dict:
        """Block until the job has compiled its steps; returns what it announced."""
        self.info = self._wait("ready", timeout)
        return self.info

    def request(self, timeout: float = 300.0, **request) -> dict:
        """Send one request to every rank and wait for rank 0's answer."""
        write_json(os.path.join(self.control, f"req.{self.k}"), request)
        result = self._wait(f"res.{self.k}", timeout)
        self.k += 1
        if "error" in result:
            raise RuntimeError(f"{self.name}: {request} failed: {result['error']}")
        return result

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the job to finish; after `timeout`, SIGKILL the process group it started."""
        if self.proc.poll() is None:
            write_json(os.path.join(self.control, f"req.{self.k}"), {"op": "stop"})
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def interleave(measure, keys: list, rounds: int) -> dict:
    """`measure(key)` for every key, `rounds` times, forward in even rounds and reversed in odd
    ones; element r of each key's list comes from round r."""
    samples = {k: [] for k in keys}
    for r in range(rounds):
        for key in keys[:: 1 if r % 2 == 0 else -1]:
            samples[key].append(measure(key))
    return samples
