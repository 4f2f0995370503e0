"""Who this process is in the job, and process 0's values for everyone."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def is_primary() -> bool:
    """True on process 0 (the one that writes checkpoints and prints)."""
    return jax.process_index() == 0


def process_index() -> int:
    """This process's index in the job, 0..process_count()-1."""
    return jax.process_index()


def process_count() -> int:
    """The number of processes in the job."""
    return jax.process_count()


def broadcast_from_primary(tree: Any) -> Any:
    """Return process 0's values of `tree` on every process, as numpy arrays.

    So every replica starts identical even when processes initialised with different seeds.
    Leaves must have the same shape and dtype on every process. A single process gets its own
    values back without communication.
    """
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    leaves, treedef = jax.tree.flatten(tree)
    host = [np.asarray(x) for x in leaves]
    # The broadcast is a psum with zeros on the other processes: bools are summed as uint8.
    sendable = [x.astype(np.uint8) if x.dtype == np.bool_ else x for x in host]
    received = multihost_utils.broadcast_one_to_all(sendable)
    out = [np.asarray(r).astype(h.dtype) for r, h in zip(received, host, strict=True)]
    return jax.tree.unflatten(treedef, out)
