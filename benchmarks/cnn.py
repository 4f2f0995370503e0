"""The tables of the CNN jobs (the summary and tables 1-8 of BENCHMARKS.md): views of one
measurement, the interleaved rounds `benchmarks.harness.run.measure` runs over the jobs of
`benchmarks.harness.jobs.plan` (each a `benchmarks.worker` or `benchmarks.torch_ddp` process).

Each entry of `TABLES` is (title, results -> markdown); the results are `measure`'s.
"""
from __future__ import annotations

from benchmarks.harness.report import comparison, fmt, median, pairs, ratio, spread, table


def summary(r: dict) -> str:
    """The headline figures, each against its target."""
    rows = [("jdp / hand-written pmap step (1 process x 2 devices, allocator tuned, "
             "alternated in-process)", median(r, "2dev+malloc:jdp/hand"), 0.98, 3),
            ("loader / train step consumption", ratio(r, "2dev:loader", "2dev:jdp"), 20, 0),
            ("jdp / PyTorch DDP, both with glibc's malloc defaults",
             ratio(r, "2dev:jdp", "torch:ddp"), 1, 2),
            ("jdp as shipped (allocator tuned) / PyTorch DDP as shipped",
             ratio(r, "2dev+malloc:jdp", "torch:ddp"), 1, 2),
            ("the same, CNN pooled with flax's `nn.max_pool`",
             ratio(r, "2dev+malloc:maxpool", "torch:ddp"), 1, 2),
            ("jdp.pmap (classic form) step / jdp.train_step (1 process x 2 devices, "
             "alternated)", median(r, "2dev+malloc:pmap/jdp"), None, 3),
            ("2 processes x 1 device / 1 process x 2 devices (glibc malloc)",
             ratio(r, "2proc:jdp", "2dev:jdp"), None, 2)]
    out = [[label, fmt(x, d), "(report)" if t is None else f"≥ {t}",
            "" if t is None or x != x else ("meets" if x >= t else "**misses**")]
           for label, x, t, d in rows]
    h = r["hlo"].get("2dev:jdp")
    ok = h and h["ops"] == 1 and 0 <= h["bytes"] - h["expected_bytes"] <= 16
    out.append(["all-reduce ops per step; bytes beyond gradient + BN stats + metrics",
                f"{h['ops']}; {h['bytes'] - h['expected_bytes']:,}" if h else "n/a",
                "1; a few scalars at most", "meets" if ok else "**check**"])
    return table(["figure (median over rounds)", "value", "target", ""], out)


def _scaling(r: dict) -> str:
    rows = []
    for tag in ("", "+malloc"):
        for k in (1, 2, 4, 8):
            if (key := f"{k}dev{tag}:jdp") in r["samples"]:
                up = ratio(r, key, f"1dev{tag}:jdp")
                rows.append([k, tag or "glibc defaults", fmt(median(r, key), 0),
                             spread(r["samples"][key]), fmt(median(r, key) / k, 0), fmt(up),
                             fmt(up / k), fmt(median(r, key, "faults_per_step"), 0)])
    return table(["devices", "allocator", "samples/s", "min–max", "per device",
                  "speedup vs 1 device", "efficiency", "page faults / step"], rows)


def _op_time(r: dict) -> str:
    if not (p := r["profile"]):
        return "No profile in this run (`--quick` skips it).\n"
    rows = [[kind, *(fmt(v[kind], 1) for v in p.values())] for kind in next(iter(p.values()))]
    rows.append(["**sum of op time**", *(fmt(sum(v.values()), 1) for v in p.values())])
    rows.append(["kernel CPU (getrusage; page faults, inside the ops above)",
                 *(fmt(median(r, k, "sys_ms_per_step"), 1) for k in p)])
    return table(["CPU ms per step (both devices)", *(f"`{k}`" for k in p)], rows)


TORCH_KEYS = [f"{job}{t}:{v}" for job, v in (("torch", "ddp"), ("2dev", "jdp"), ("2dev", "maxpool"),
                                              ("2proc", "jdp")) for t in ("", "+malloc")]
TABLES = [  # (title, results -> markdown), in BENCHMARKS.md's order
    ("Summary", summary),
    ("1. jdp's step (global arrays, and the jdp.pmap form) against a hand-written pmap step, "
     "1 process x 2 devices", lambda r: comparison(r, [f"2dev{t}:{v}" for t in ("", "+malloc")
                                                      for v in ("jdp", "hand", "pmap")],
                                                   "2dev:hand")),
    ("1b. Alternated in-process: ratios finer than the rounds", lambda r: table(
        ["job: a / b (alternated in-process)", "median", "min–max (per mille)"],
        [[f"`{k}`", fmt(median(r, k), 3), spread([x * 1000 for x in v])]
         for k, v in r["samples"].items() if "/" in k])),
    ("2. Scaling over simulated CPU devices (one process, 64 examples per device)", _scaling),
    ("3. Loader throughput against the train step",
     lambda r: pairs(r, [("loader / train step", "2dev:loader", "2dev:jdp")])),
    ("4. Two processes (jdp.launch, gloo) against one process with two devices",
     lambda r: pairs(r, [("glibc malloc", "2proc:jdp", "2dev:jdp"),
                         ("both +malloc", "2proc+malloc:jdp", "2dev+malloc:jdp")])),
    ("5. PyTorch DDP on the same machine (global batch 128)", lambda r: pairs(r, [
        ("both with glibc's malloc defaults", "2dev:jdp", "torch:ddp"),
        ("jdp as shipped vs torch as shipped", "2dev+malloc:jdp", "torch:ddp"),
        ("both +malloc", "2dev+malloc:jdp", "torch+malloc:ddp"),
        ("`nn.max_pool` CNN, jdp as shipped vs torch as shipped", "2dev+malloc:maxpool",
         "torch:ddp")]) + "\n" + comparison(r, TORCH_KEYS, "torch:ddp")),
    ("6. All-reduce traffic per step (compiled HLO)", lambda r: table(
        ["job:variant", "all-reduce ops", "arrays in them", "bytes / step / device",
         "gradient + BN statistics + metrics", "other bytes", "scratch MiB / device"],
        [[f"`{k}`", h["ops"], h["arrays"], f"{h['bytes']:,}", f"{h['expected_bytes']:,}",
          f"{h['bytes'] - h['expected_bytes']:,}", fmt(h["temp_bytes"] / 2**20, 1)]
         for k, h in r["hlo"].items()])),
    ("7. Where the time goes: op time by kind (jax.profiler trace, 5 steps)", _op_time),
    ("8. The global core against the jdp.pmap form", lambda r: pairs(
        r, [(f"{job}: jdp.train_step / jdp.pmap.train_step", f"{job}:jdp", f"{job}:pmap")
            for job in ("2dev", "2dev+malloc", "2proc", "2proc+malloc")])),
]
