"""BENCHMARKS.md's generated block: machine, versions, job commands and tables, no prose.

Each table is a function of the run's results `r` (`benchmarks.run.measure`) returning
markdown. `splice` replaces the text between `BEGIN` and `END`, keeping the analysis around it.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics

BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"
NAN = float("nan")


def _finite(values) -> list[float]:
    return [v for v in values if v == v]


def spread(values) -> str:
    """"min–max" of a sample: how noisy the rounds were."""
    v = _finite(values)
    return f"{min(v):.0f}–{max(v):.0f}" if v else "n/a"


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table."""
    return "".join("| " + " | ".join(str(c) for c in row) + " |\n"
                   for row in [header, ["---"] * len(header), *rows])


def fmt(x: float, digits: int = 2) -> str:
    """A number for a table; "n/a" for NaN (not measured)."""
    return "n/a" if x != x else f"{x:,.{digits}f}"


def median(r: dict, key: str, field: str | None = None) -> float:
    """Median over rounds of a key's samples/s or paired ratio, or of one `field` of its
    answers (page faults, CPU ms per step); NaN if not measured."""
    values = (r["samples"].get(key, []) if field is None
              else [d.get(field, NAN) for d in r["details"].get(key, [])])
    return statistics.median(_finite(values)) if _finite(values) else NAN


def ratio(r: dict, a: str, b: str) -> float:
    """Median over rounds of a's samples/s / b's in the same round: steadier on shared cores
    than the ratio of two medians (NaN if either is missing)."""
    s = r["samples"]
    if not {a, b} <= s.keys():
        return NAN
    return statistics.median(x / y for x, y in zip(s[a], s[b], strict=True))


def comparison(r: dict, keys: list[str], base: str) -> str:
    """Rates, spreads, ratios to `base`, and per-step page faults and CPU of some keys."""
    return table(["job:variant", "samples/s (median)", "min–max", f"ratio to `{base}`",
                  "page faults / step", "user CPU ms / step", "system CPU ms / step"],
                 [[f"`{k}`", fmt(median(r, k), 0), spread(r["samples"][k]),
                   fmt(ratio(r, k, base)), fmt(median(r, k, "faults_per_step"), 0),
                   fmt(median(r, k, "user_ms_per_step"), 1),
                   fmt(median(r, k, "sys_ms_per_step"), 1)] for k in keys if k in r["samples"]])


def pairs(r: dict, rows: list[tuple[str, str, str]]) -> str:
    """One row per (label, a, b) measured: both rates, the per-round ratio a / b."""
    return table(["comparison", "a: samples/s", "b: samples/s", "a / b"],
                 [[label, f"`{a}` {fmt(median(r, a), 0)}", f"`{b}` {fmt(median(r, b), 0)}",
                   fmt(ratio(r, a, b))] for label, a, b in rows if {a, b} <= r["samples"].keys()])


def _version(pkg: str) -> str:
    try:
        return f"{pkg} {importlib.metadata.version(pkg)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{pkg} (not installed)"


def header(r: dict) -> str:
    """When and how this block was made, on what machine, with which job commands."""
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    s, mem = r["settings"], os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = " / ".join("/".join(f"{x:.1f}" for x in r[k]) for k in ("load_before", "load_after"))
    versions = "; ".join(map(_version, ("jax", "jaxlib", "flax", "optax", "numpy", "torch")))
    return "\n".join([
        f"Generated {r['generated']} by `{r['command']}`: {s['rounds']} interleaved rounds of "
        f"about {s['target_s']} s per (job, variant); {r['seconds']:.0f} s in all.\n",
        f"- CPU: {cpu}, {os.cpu_count()} cores; {mem:.0f} GiB; {platform.system()} "
        f"{platform.release()}, glibc {platform.libc_ver()[1]}",
        f"- Python {platform.python_version()}; {versions}",
        f"- Load average before / after: {load} (other jobs share these cores)",
        *[f"- Note: {n}" for n in r["notes"]], "\nJobs (`$DIR`: a temporary directory):\n",
        *[f"- `{name}`: `{cmd}`" for name, cmd in r["commands"].items()], ""])


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
TABLES = [  # (title, results -> markdown); run.py adds the tables that measure their own
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


def splice(old: str | None, block: str) -> str:
    """`old` with the text between `BEGIN` and `END` replaced by `block` (a new file with a
    title and the block if `old` has no markers)."""
    if old and BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        return f"{head}{BEGIN}\n{block}\n{END}{rest.split(END, 1)[1]}"
    return f"# jdp benchmarks\n\n{BEGIN}\n{block}\n{END}\n"
