"""`DistributedSampler`: the example indices of one epoch that one process reads (torch's).

Kept apart from the Loader so that the epoch's order (and, in `jdp._position`, the position
inside it) has one home.
"""
from __future__ import annotations

import numbers
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np


def _require_int(owner: str, name: str, value: Any, minimum: int, fix: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{owner}: {name}={value!r} is a {type(value).__name__}; expected an "
                        f"int: {fix}")
    if value < minimum:
        raise ValueError(f"{owner}: {name}={value}; expected an int >= {minimum}: {fix}")
    return int(value)


class DistributedSampler:
    """The indices of one epoch that this process (rank) reads: torch's DistributedSampler.

    Each of `num_replicas` ranks gets `len(sampler)` indices: the epoch's index list (a
    permutation seeded by `seed + epoch` when `shuffle`, else `0..n-1`) is padded by repeating
    it from its start up to a multiple of `num_replicas` (or, with `drop_last`, cut down to
    one), and rank r takes `indices[r::num_replicas]`. The unshuffled lists equal torch's
    exactly; the shuffled ones use `np.random.default_rng(seed + epoch).permutation(n)` instead of
    torch's `randperm` (same on every process, but not torch's numbers).

    Fewer examples than replicas is an error (torch's one case jdp refuses): some ranks
    would get nothing but padding, or, with `drop_last`, every rank nothing at all.

    Args:
        num_examples: number of examples in the source (`len(source)`), at least 1.
        num_replicas: number of ranks; default `jax.process_count()`.
        rank: this rank, in `range(num_replicas)`; default `jax.process_index()`.
        shuffle: permute the indices each epoch (seeded by `seed + epoch`).
        seed: base seed, the same on every process.
        drop_last: drop the tail that does not split evenly instead of padding.

    Example:
        >>> s = DistributedSampler(10, num_replicas=3, rank=1, shuffle=False)
        >>> list(s), len(s)
        ([1, 4, 7, 0], 4)
    """

    def __init__(self, num_examples: int, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        owner = "DistributedSampler"
        self.num_examples = _require_int(owner, "num_examples", num_examples, 1,
                                         "pass len(source) of a non-empty source")
        num_replicas = jax.process_count() if num_replicas is None else num_replicas
        self.num_replicas = _require_int(owner, "num_replicas", num_replicas, 1,
                                         "pass the number of processes (default: all)")
        rank = jax.process_index() if rank is None else rank
        self.rank = _require_int(owner, "rank", rank, 0, "pass rank in range(num_replicas)")
        if self.rank >= self.num_replicas:
            raise ValueError(f"{owner}: rank={self.rank} is not below num_replicas="
                             f"{self.num_replicas}; pass rank in range({self.num_replicas})")
        self.seed = _require_int(owner, "seed", seed, 0, "pass a non-negative seed")
        self.shuffle, self.drop_last, self.epoch = bool(shuffle), bool(drop_last), 0
        if self.num_examples < self.num_replicas:
            raise ValueError(f"{owner}: num_examples={self.num_examples} < num_replicas="
                             f"{self.num_replicas}: some ranks would get no example at all; "
                             "use fewer processes or more data")
        # torch: ceil((n - W) / W) with drop_last and a remainder, which is floor(n / W).
        per_rank = (self.num_examples // self.num_replicas if self.drop_last
                    else -(-self.num_examples // self.num_replicas))
        self.num_samples = per_rank
        self.total_size = per_rank * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Use epoch `epoch`'s permutation (call it before each epoch when shuffling)."""
        self.epoch = _require_int("DistributedSampler.set_epoch", "epoch", epoch, 0,
                                  "pass the epoch number, counted from 0")

    def indices(self) -> np.ndarray:
        """This rank's indices for the current epoch, an int64 array of length `len(self)`."""
        # np.resize repeats the order from its start: torch's padding, several times if needed.
        order = np.resize(self.order(), self.total_size)
        return order[self.rank:self.total_size:self.num_replicas]

    def order(self) -> np.ndarray:
        """The current epoch's example order before padding and striding (same on every rank).

        Rank r's indices are this list, padded, taken every `num_replicas` from position r;
        so after each rank has read its first k indices, all ranks together have read the first
        `k * num_replicas` positions: a prefix of this list (what an elastic resume needs).
        """
        if self.shuffle:
            order = np.random.default_rng(self.seed + self.epoch).permutation(self.num_examples)
        else:
            order = np.arange(self.num_examples)
        return order.astype(np.int64)

    def is_padding(self) -> np.ndarray:
        """Bool array aligned with `indices()`: True where the index is torch's padding.

        Over all ranks, the positions where it is False hold every example exactly once.
        """
        return np.arange(self.rank, self.total_size, self.num_replicas) >= self.num_examples

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"DistributedSampler(num_examples={self.num_examples}, num_replicas="
                f"{self.num_replicas}, rank={self.rank}, shuffle={self.shuffle}, seed="
                f"{self.seed}, drop_last={self.drop_last}, epoch={self.epoch})")
