"""BENCHMARKS.md's generated block: the header (machine, versions, job commands), the pieces
every table is made of (medians, ratios, spreads, markdown tables), and `splice`, which replaces
the text between `BEGIN` and `END`, keeping the analysis around it. No prose, no table of its
own: each table lives in its benchmark's module (`benchmarks.harness.run.TABLES` lists them).
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


def splice(old: str | None, block: str) -> str:
    """`old` with the text between `BEGIN` and `END` replaced by `block` (a new file with a
    title and the block if `old` has no markers)."""
    if old and BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        return f"{head}{BEGIN}\n{block}\n{END}{rest.split(END, 1)[1]}"
    return f"# jdp benchmarks\n\n{BEGIN}\n{block}\n{END}\n"
