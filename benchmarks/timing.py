"""Interleaved rounds and their summaries: medians, per-round ratios, spreads.

On a shared 2-core machine another job can halve a measurement for a few seconds. Running the
compared variants back to back inside a round (forward order in even rounds, reversed in odd
ones) exposes each round's variants to about the same load, so a ratio taken within a round is
far steadier than the ratio of two separately taken medians; the suite reports both kinds of
figure from the same samples.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence


def round_order(keys: Sequence[Hashable], round_index: int) -> list:
    """The order to run `keys` in a round: as given in even rounds, reversed in odd ones
    (A B C, C B A, ...), so no variant always runs right after the same neighbour."""
    return list(keys) if round_index % 2 == 0 else list(reversed(keys))


def interleave(measure: Callable[[Hashable], float], keys: Sequence[Hashable],
               rounds: int) -> dict[Hashable, list[float]]:
    """Call `measure(key)` for every key, `rounds` times, in `round_order`; collect the
    results per key (element r of each list comes from round r)."""
    samples: dict[Hashable, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        for key in round_order(keys, r):
            samples[key].append(measure(key))
    return samples


def median(values: Iterable[float]) -> float:
    """Median of the finite values (NaN if there are none)."""
    finite = [v for v in values if v == v]
    return statistics.median(finite) if finite else float("nan")


def ratio_median(samples: Mapping[Hashable, Sequence[float]], a: Hashable,
                 b: Hashable) -> float:
    """Median over rounds of samples[a][r] / samples[b][r]: the round-paired ratio."""
    return median(x / y for x, y in zip(samples[a], samples[b], strict=False) if y)


def spread(values: Sequence[float]) -> str:
    """"min–max" of a sample, for the tables: how noisy the rounds were."""
    finite = [v for v in values if v == v]
    return f"{min(finite):.0f}–{max(finite):.0f}" if finite else "n/a"
