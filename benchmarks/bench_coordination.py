"""What jdp's talk with the coordination service costs as the job grows (`make bench`, table 14).

Three measurements, each against the thing itself where this machine allows it:

1. Agreement points (`jdp.broadcast`, the Loader, every checkpoint save) at N = 2 ... 4,096
   simulated processes: threads running the real logic (`jdp.distributed._agree`) against the
   counting in-memory store (`tests/doubles/memstore.py`): requests and bytes per process and
   at the coordinator, keys held afterwards, next to the algorithm jdp used before (every
   process read every other's hash: `_before`), run the same way up to N = 256.
2. The in-job watchdog (srun/mpirun) and the roll call: requests per process per period with
   the store; the roll call over real TCP with N threads.
3. Real processes: `python -m jdp.launch --nproc_per_node N --devices_per_process 1`, the
   milliseconds per agreement point against JAX's coordination service, before and after.

Run: `python -m benchmarks.bench_coordination` (prints the table).
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.harness import report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FACTS = [(f"['layer{i}']['w']", "float32[1024, 1024]") for i in range(16)]


def _before(client, rank: int, count: int, rounds: dict, topic: str, facts: list) -> None:
    """The agreement before issue 32, for comparison: 3 keys per process kept forever, then a
    blocking get of every process's hash, one by one (N round trips per process)."""
    n = rounds[topic] = rounds.get(topic, 0) + 1
    prefix, text = f"jdp/agree/{topic}/{n}", json.dumps([list(f) for f in facts])
    client.key_value_set(f"{prefix}/facts/{rank}", text)
    client.key_value_set(f"{prefix}/hash/{rank}", hashlib.sha256(text.encode()).hexdigest())
    client.key_value_set(f"jdp/agree/at/{rank}", json.dumps([topic, n, "bench"]),
                         allow_overwrite=True)
    hashes = [client.blocking_key_value_get(f"{prefix}/hash/{r}", 60_000) for r in range(count)]
    if len(set(hashes)) != 1:
        raise ValueError("the processes disagree")


def _after(client, rank: int, count: int, rounds: dict, topic: str, facts: list) -> None:
    from jdp.distributed import _agree
    _agree.agree_in_store(client, _agree.Process(rank, count, rounds), topic, facts, "bench",
                          "", 60.0, poll_s=60.0)


def simulate(count: int, how, points: int = 1) -> dict:
    """`points` agreement points of `count` threads on one counting store; the counts."""
    from tests.doubles import memstore  # the double lives with the tests; run from the root
    store, errors = memstore.Store(), []

    def process(rank):
        rounds: dict = {}
        try:
            for _ in range(points):
                how(store.client(rank), rank, count, rounds, "tree", FACTS)
        except Exception as e:  # noqa: BLE001 - reported in the table
            errors.append(e)

    old = threading.stack_size(256 * 1024)
    threads = [threading.Thread(target=process, args=(r,), daemon=True) for r in range(count)]
    threading.stack_size(old)
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = (time.perf_counter() - start) / points
    c = [store.counts[r] for r in range(count)]
    if errors:
        raise RuntimeError(f"{len(errors)} simulated processes failed: {errors[0]}")
    return {"n": count, "req_max": max(x.requests for x in c) / points,
            "req_mean": sum(x.requests for x in c) / count / points,
            "bytes_mean": sum(x.sent + x.received for x in c) / count / points,
            "bytes_max": max(x.sent + x.received for x in c) / points,
            "coord_req": sum(x.requests for x in c) / points,
            "coord_bytes": sum(x.sent + x.received for x in c) / points,
            "keys": len(store.keys()), "held": store.bytes_held(), "s": seconds}


def agreement_rows(counts=(2, 8, 64, 256, 1024, 4096), before_up_to: int = 256) -> list:
    rows = []
    for n in counts:
        a = simulate(n, _after, points=3)
        b = simulate(n, _before, points=3) if n <= before_up_to else None
        rows.append([n, f"{a['req_mean']:.2f} / {a['req_max']:.0f}",
                     f"{b['req_mean']:.0f} / {b['req_max']:.0f}" if b else f"{n + 3} (model)",
                     f"{a['bytes_mean']:.0f} / {a['bytes_max']:,.0f}",
                     f"{b['bytes_mean']:,.0f}" if b else "",
                     f"{a['coord_req']:,.0f}",
                     f"{b['coord_req']:,.0f}" if b else f"{n * n + 3 * n:,} (model)",
                     f"{a['keys']} / {a['held']:,}",
                     f"{b['keys']:,} / {b['held']:,}" if b else "",
                     f"{a['s'] * 1e3:.1f}", f"{b['s'] * 1e3:.1f}" if b else ""])
    return rows


def watchdog_rows(cases=((8, 10.0), (256, 10.0), (1024, 10.0), (1024, 600.0)),
                  seconds: float | None = None) -> list:
    """Per (N, JDP_PROGRESS_TIMEOUT): N publishers and process 0's watcher on the store for
    `seconds` (default: two periods, at least 2 s), every rank making progress."""
    return [_watch_once(n, timeout_s, seconds) for n, timeout_s in cases]


def _watch_once(n: int, timeout_s: float, seconds: float | None) -> list:
    from jdp.distributed import _watch
    from jdp.job import progress as _progress
    from tests.doubles import memstore
    store = memstore.Store()
    slots = [bytearray(_progress.SLOT_SIZE) for _ in range(n)]
    every = _watch.period(timeout_s)
    seconds = seconds or max(2.0, 2 * every)
    threads = [threading.Thread(target=_watch._publish, daemon=True, args=(
        store.client(r), r, slots[r], threading.main_thread(), every)) for r in range(n)]
    threads.append(threading.Thread(target=_watch._watch, daemon=True,
                                    args=(store.client(0), n, timeout_s, every)))
    for t in threads:
        t.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:   # every rank makes progress (a step) 10 times a second
        for k, slot in enumerate(slots):
            _progress.HEAD.pack_into(slot, 0, int(time.monotonic() * 10), k, 1, 0.0)
        time.sleep(0.1)
    store.close()
    for t in threads:
        t.join(every + 5)
    c = [store.counts[r] for r in range(1, n)]
    return [n, f"{timeout_s:g}", f"{every:g}",
            f"{statistics.mean(x.requests for x in c) / seconds:.2f}",
            f"{statistics.mean(x.sent + x.received for x in c) / seconds:.0f}",
            f"{store.counts[0].received / seconds:,.0f}", len(store.keys())]


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def roll_call_rows(counts=(2, 64, 512, 1024)) -> list:
    """The roll call over real TCP on 127.0.0.1: N threads, one of them process 0."""
    from jdp.distributed import _rendezvous
    rows = []
    for n in counts:
        port, failed = _free_port(), []

        def process(rank, port=port, n=n, failed=failed):
            try:
                conns, _ = _rendezvous.roll_call("127.0.0.1", port, rank, n, 120)
                for conn in conns.values():
                    conn.close()
            except Exception as e:  # noqa: BLE001 - reported in the table
                failed.append(e)

        threads = [threading.Thread(target=process, args=(r,), daemon=True) for r in range(n)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rows.append([n, f"{time.perf_counter() - start:.2f}", n - 1, 2,
                     "ok" if not failed else f"{len(failed)} failed: {failed[0]}"])
    return rows


POINTS = """
import os, sys, time, json
import jax
import jdp
from jdp.distributed import _agree, _init
from benchmarks.bench_coordination import FACTS, _before
jdp.initialize()
client, me, n = _init.coordination_client(), jax.process_index(), jax.process_count()
out = {}
for name in ("before", "after"):
    rounds = {}
    jdp.barrier(name)
    start = time.perf_counter()
    for _ in range(int(os.environ["POINTS"])):
        if name == "before":
            _before(client, me, n, rounds, "b", FACTS)
        else:
            _agree.agree_in_store(client, _agree.Process(me, n, rounds), "a", FACTS, "x", "", 60)
    out[name] = (time.perf_counter() - start) / int(os.environ["POINTS"])
if me == 0:
    print("POINTS " + json.dumps(out), flush=True)
"""


SERVICE = """
import json, time
import jax
from jax._src import distributed as d  # the coordination client, as jdp's _init reads it
from benchmarks.bench_coordination import _service_times
jax.distributed.initialize("127.0.0.1:%d", 1, 0)
print("SERVICE " + json.dumps(_service_times(d.global_state.client)), flush=True)
"""


def _service_times(client, calls: int = 2000, keys: int = 16384) -> dict:
    """Microseconds per set, get and increment; ms for a directory read of `keys` hashes."""
    out = {}
    start = time.perf_counter()
    for i in range(calls):
        client.key_value_set(f"b/set/{i}", "x" * 32)
    out["set_us"] = (time.perf_counter() - start) / calls * 1e6
    start = time.perf_counter()
    for i in range(calls):
        client.blocking_key_value_get(f"b/set/{i}", 1000)
    out["get_us"] = (time.perf_counter() - start) / calls * 1e6
    start = time.perf_counter()
    for _ in range(calls):
        client.key_value_increment("b/count", 1)
    out["increment_us"] = (time.perf_counter() - start) / calls * 1e6
    for i in range(keys):
        client.key_value_set(f"b/hash/{i}", "0123456789abcdef" * 2)
    start = time.perf_counter()
    got = client.key_value_dir_get("b/hash/")
    out["dir_ms"] = (time.perf_counter() - start) * 1e3
    out["dir_keys"] = len(got)
    return out


def service_row() -> dict:
    """JAX's coordination service on this machine, one process talking to it over 127.0.0.1."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", SERVICE % _free_port()],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    line = [x for x in done.stdout.splitlines() if x.startswith("SERVICE ")]
    if not line:
        raise RuntimeError(f"the service measurement failed: {done.stderr[-300:]}")
    return json.loads(line[0].split(" ", 1)[1])


def real_rows(counts=(2, 4, 8), points: int = 30) -> list:
    """ms per agreement point with N real processes under jdp.launch, before and after."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="jdp-bench-coord-") as tmp:
        script = os.path.join(tmp, "points.py")
        with open(script, "w") as f:
            f.write(POINTS)
        env = {**os.environ, "POINTS": str(points), "JAX_PLATFORMS": "cpu",
               "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for n in counts:
            done = subprocess.run([sys.executable, "-m", "jdp.launch", "--nproc_per_node", str(n),
                                   "--devices_per_process", "1", script], env=env, cwd=REPO,
                                  capture_output=True, text=True, timeout=600)
            line = [x for x in done.stdout.splitlines() + done.stderr.splitlines()
                    if "POINTS " in x]
            if done.returncode or not line:
                rows.append([n, f"failed ({done.returncode}): {done.stderr[-200:]!r}", ""])
                continue
            r = json.loads(line[-1].split("POINTS ", 1)[1])
            rows.append([n, f"{r['before'] * 1e3:.2f}", f"{r['after'] * 1e3:.2f}"])
    return rows


def table(quick: bool = False) -> str:
    """The markdown tables of this module."""
    counts = (2, 8, 64, 256, 1024) if quick else (2, 8, 64, 256, 1024, 4096)
    agreement = report.table(
        ["N", "requests per process, mean / max: after", "before", "bytes per process, "
         "mean / max: after", "before (mean)", "requests at the coordinator: after", "before",
         "keys / bytes held after 3 points: after", "before", "ms per point (threads): after",
         "before"], agreement_rows(counts))
    watchdog = report.table(["N", "JDP_PROGRESS_TIMEOUT s", "period s",
                             "requests per rank per s", "bytes per rank per s",
                             "process 0 reads bytes per s", "keys held"],
                            watchdog_rows(((8, 10.0), (256, 600.0)) if quick else
                                          ((8, 10.0), (256, 10.0), (1024, 10.0), (1024, 600.0))))
    roll = report.table(["N", "seconds", "connections held by process 0",
                         "messages per process", "outcome"],
                        roll_call_rows((2, 64, 512) if quick else (2, 64, 512, 1024)))
    real = report.table(["processes", "ms per agreement point: before", "after"],
                        real_rows((2, 4) if quick else (2, 4, 8, 16)))
    svc = service_row()
    service = report.table(["set", "blocking get (key present)", "increment",
                            f"directory read of {svc['dir_keys']:,} hashes"],
                           [[f"{svc['set_us']:.0f} µs", f"{svc['get_us']:.0f} µs",
                             f"{svc['increment_us']:.0f} µs", f"{svc['dir_ms']:.1f} ms"]])
    return ("Agreement points, simulated: N threads run the agreement logic against the "
            "counting in-memory store (one Python process: the ms column is this machine's "
            "GIL, not a network). Before: each process read every other's hash.\n\n"
            f"{agreement}\nThe in-job watchdog (srun/mpirun), simulated for two periods (at "
            f"least 2 s) with every rank making progress; before, the period was 0.5 s whatever "
            f"the timeout:\n\n{watchdog}\n"
            f"The roll call in `jdp.initialize()`, real TCP on 127.0.0.1, N threads:\n\n{roll}\n"
            "Real processes (`python -m jdp.launch --nproc_per_node N --devices_per_process 1`, "
            f"{os.cpu_count()} CPU cores), 30 agreement points of a 16-leaf tree against JAX's "
            f"coordination service:\n\n{real}\nJAX's coordination service on this machine, one "
            f"client over 127.0.0.1, per request (the figures BENCHMARKS.md's model "
            f"scales):\n\n{service}")


if __name__ == "__main__":
    print(table(quick="--quick" in sys.argv))
