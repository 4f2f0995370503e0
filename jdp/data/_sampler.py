"""`DistributedSampler` (which examples each process reads) and the position inside an epoch.

Rank r reads the positions r, r + W, r + 2W, ... of the epoch's (padded) order. When every
rank has read its first k indices (the ranks step together), all of them together have read
positions [0, k * W): a prefix of the order. So the position of a whole job is one number, the
offset: how many examples of the epoch's order are consumed. A pass over an epoch that starts
at offset `start` splits `order[start:]` over the ranks as a fresh epoch is split, so a
position saved on W ranks continues on W' ranks (or with another batch size) with exactly the
examples not yet consumed, each once.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jdp.distributed import require_job
from jdp.job import values


def _require_int(owner: str, name: str, value: Any, minimum: int, fix: str) -> int:
    """`value` as an int >= `minimum` (`jdp.job.values.integer`); kept under this name for
    the Loader and `jdp.evaluate`."""
    return values.integer(owner, name, value, minimum=minimum, fix=fix)


class DistributedSampler:
    """The indices of one epoch that this process (rank) reads.

    Each of `num_replicas` ranks gets `len(sampler)` indices: the epoch's index list (a
    permutation seeded by `seed + epoch` when `shuffle`, else `0..n-1`) is padded by repeating
    it from its start up to a multiple of `num_replicas` (or, with `drop_last`, cut down to
    one), and rank r takes `indices[r::num_replicas]`. Every process computes the same list,
    so no communication is needed.

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
        owner = "jdp.data.DistributedSampler"
        if num_replicas is None or rank is None:
            require_job("jdp.data.DistributedSampler")
        self.num_examples = _require_int(owner, "num_examples", num_examples, 1,
                                         "pass len(source) of a non-empty source")
        num_replicas = jax.process_count() if num_replicas is None else num_replicas
        self.num_replicas = _require_int(owner, "num_replicas", num_replicas, 1,
                                         "pass the number of processes (default: all)")
        rank = jax.process_index() if rank is None else rank
        self.rank = _require_int(owner, "rank", rank, 0, "pass rank in range(num_replicas)")
        if self.rank >= self.num_replicas:
            raise values.wrong_value(owner, "rank", self.rank,
                                     f"below num_replicas={self.num_replicas}",
                                     f"pass rank in range({self.num_replicas})")
        self.seed = _require_int(owner, "seed", seed, 0, "pass a non-negative seed")
        self.shuffle = values.flag(owner, "shuffle", shuffle, fix="True permutes each epoch")
        self.drop_last = values.flag(owner, "drop_last", drop_last,
                                     fix="True drops the tail that does not split evenly")
        self.epoch = 0
        if self.num_examples < self.num_replicas:
            raise ValueError(f"{owner}: num_examples={self.num_examples} < num_replicas="
                             f"{self.num_replicas}: some ranks would get no example at all; "
                             "use fewer processes or more data")
        self.num_samples = self.pass_length(0)
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Use epoch `epoch`'s permutation (call it before each epoch when shuffling)."""
        self.epoch = _require_int("jdp.data.DistributedSampler.set_epoch", "epoch", epoch, 0,
                                  "pass the epoch number, counted from 0")

    def indices(self) -> np.ndarray:
        """This rank's indices for the current epoch, an int64 array of length `len(self)`."""
        return self.pass_rows(0)[0]

    def is_padding(self) -> np.ndarray:
        """Bool array aligned with `indices()`: True where the index repeats for padding."""
        return ~self.pass_rows(0)[1]

    def order(self) -> np.ndarray:
        """The current epoch's example order before padding and striding (same on every rank)."""
        n = self.num_examples
        rng = np.random.default_rng(self.seed + self.epoch)
        return (rng.permutation(n) if self.shuffle else np.arange(n)).astype(np.int64)

    def pass_rows(self, start: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's indices of `order()[start:]` (padded as above), and its real-row mask."""
        rest = self.order()[start:]
        world, left = self.num_replicas, len(rest)
        total = self.pass_length(start) * world
        padded = np.resize(rest, total) if left else rest[:0]
        slots = np.arange(self.rank, total, world)
        return padded[slots], slots < left

    def pass_length(self, start: int) -> int:
        """How many indices (padding included) each rank reads in a pass starting at `start`."""
        left, world = self.num_examples - start, self.num_replicas
        return left // world if self.drop_last else -(-left // world)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"DistributedSampler(num_examples={self.num_examples}, num_replicas="
                f"{self.num_replicas}, rank={self.rank}, shuffle={self.shuffle}, seed="
                f"{self.seed}, drop_last={self.drop_last}, epoch={self.epoch})")


# Settings that fix the epoch's order; a position means nothing under others.
ORDER_CONFIG = ("num_examples", "shuffle", "seed", "sampler_drop_last")
# Settings that fix which batch a step is; under others the offset is restored instead.
SPLIT_CONFIG = ("num_replicas", "batch_size", "drop_last")


class Position(NamedTuple):
    epoch: int
    start: int  # offset at which the current pass over the epoch began
    step: int   # batches of the pass handed out


def offset(sampler: DistributedSampler, position: Position, batch_size: int) -> int:
    """Examples of the epoch's order consumed by all ranks together at `position`."""
    read = min(position.step * batch_size, sampler.pass_length(position.start))
    return min(position.start + read * sampler.num_replicas, sampler.num_examples)


def restored(saved: Mapping, mine: Mapping, num_batches: Callable[[int], int]) -> Position:
    """The position to continue from, given a saved `Loader.state_dict()` and this Loader's.

    With the same split (ranks, batch size) the saved (start, step) is taken as is: the same
    batches follow, bitwise. Under another split the pass restarts at the saved offset.
    `num_batches(start)` is the number of batches of a pass starting at `start`.
    """
    where, fix = "Loader.load_state_dict", "pass a dict from Loader.state_dict()"
    differ = {k: (saved[k], mine[k]) for k in ORDER_CONFIG + SPLIT_CONFIG
              if k in saved and saved[k] != mine[k]}
    elastic = not differ.keys().isdisjoint(SPLIT_CONFIG)
    if not differ.keys().isdisjoint(ORDER_CONFIG) or (elastic and "offset" not in saved):
        raise ValueError(f"{where}: saved vs this loader's settings differ {differ}; build the "
                         "Loader and sampler as they were when saved")
    epoch = _require_int(where, "epoch", saved.get("epoch"), 0, fix)
    if elastic:
        at = _require_int(where, "offset", saved.get("offset"), 0, fix)
        if at > mine["num_examples"]:
            raise ValueError(f"{where}: offset={at} is past the {mine['num_examples']} "
                             f"examples of an epoch; {fix} of an equal dataset")
        return Position(epoch, at, 0)
    start = _require_int(where, "start", saved.get("start", 0), 0, fix)
    step = _require_int(where, "step", saved.get("step"), 0, fix)
    if start > mine["num_examples"] or step > num_batches(start):
        raise ValueError(f"{where}: step={step} (from offset {start}) is past the "
                         f"{num_batches(start)} batches of the epoch; {fix} by an equal Loader")
    return Position(epoch, start, step)
