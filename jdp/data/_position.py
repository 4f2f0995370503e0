"""The Loader's position inside an epoch, as a global offset that survives a change of world size.

torch's DistributedSampler gives rank r the positions r, r + W, r + 2W, ... of the epoch's
(padded) order. When every rank has read its first k indices (the ranks step together), all
of them together have read positions [0, k * W): a prefix of the order. So the position of a
whole job is one number, the offset: how many examples of the epoch's order are consumed.

A pass over an epoch starts at offset `start` (0 for a fresh epoch). Its examples are
`order[start:]`, split over the ranks exactly as torch splits a fresh epoch (padded from the
pass's start to a multiple of the ranks, or cut with the sampler's `drop_last`; rank r takes
every W-th from r; padding masked). With `start == 0` this is the sampler's own split, so a
fresh epoch is torch's. A checkpoint saved on W ranks restores onto W' ranks (or another
batch size) by starting a pass at the saved offset: the examples not yet consumed, each once.
With the same ranks and batch size the saved (start, step) is restored as is: bitwise.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from jdp.data._sampler import DistributedSampler, _require_int

# Settings that fix the epoch's order; a position means nothing under others.
ORDER_CONFIG = ("num_examples", "shuffle", "seed", "sampler_drop_last")
# Settings that fix which batch a step is; under others the offset is restored instead.
SPLIT_CONFIG = ("num_replicas", "batch_size", "drop_last")


class Position(NamedTuple):
    epoch: int
    start: int  # offset at which the current pass over the epoch began
    step: int   # batches of the pass handed out


def pass_rows(sampler: DistributedSampler, start: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's example indices from offset `start` on, and the mask of real (unpadded) ones."""
    if start == 0:
        return sampler.indices(), ~sampler.is_padding()
    rest = sampler.order()[start:]
    world, left = sampler.num_replicas, len(rest)
    total = left // world * world if sampler.drop_last else -(-left // world) * world
    padded = np.resize(rest, total) if left else rest[:0]
    slots = np.arange(sampler.rank, total, world)
    return padded[slots], slots < left


def pass_length(sampler: DistributedSampler, start: int) -> int:
    """How many indices (padding included) each rank reads in a pass starting at `start`."""
    left, world = sampler.num_examples - start, sampler.num_replicas
    return left // world if sampler.drop_last else -(-left // world)


def offset(sampler: DistributedSampler, position: Position, batch_size: int) -> int:
    """Examples of the epoch's order consumed by all ranks together at `position`."""
    per_rank = pass_length(sampler, position.start)
    read = min(position.step * batch_size, per_rank) * sampler.num_replicas
    return min(position.start + read, sampler.num_examples)


def restored(saved: Mapping, mine: Mapping, num_batches) -> Position:
    """The position to continue from, given a saved `state_dict()` and this Loader's.

    `num_batches(start)` is the number of batches of a pass starting at `start`.
    """
    where = "Loader.load_state_dict"
    differ = {k: (saved[k], mine[k]) for k in ORDER_CONFIG if k in saved and saved[k] != mine[k]}
    elastic = any(k in saved and saved[k] != mine[k] for k in SPLIT_CONFIG)
    if differ or (elastic and "offset" not in saved):
        differ.update({k: (saved[k], mine[k]) for k in SPLIT_CONFIG
                       if k in saved and saved[k] != mine[k]})
        raise ValueError(f"{where}: saved vs this loader's settings differ {differ}; build the "
                         "Loader and sampler as they were when saved")
    fix = "pass a dict from Loader.state_dict()"
    epoch = _require_int(where, "epoch", saved.get("epoch"), 0, fix)
    if elastic:  # another world size or batch size: continue at the consumed offset
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
