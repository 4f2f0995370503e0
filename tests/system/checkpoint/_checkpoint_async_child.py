"""Processes for test_checkpoint_async.py (beside it): an asynchronous save, then a way out.

Run as `python tests/system/checkpoint/_checkpoint_async_child.py EXIT DIRECTORY MARKER`; EXIT
is "return", "raise" or "sigterm" (wait for SIGTERM, handled by jdp.preempted(), then return).
"""
import sys
import time

import numpy as np

import jdp

BIG = 4_000_000  # 16 MB per leaf: the background write takes a noticeable while


def values(step: int) -> dict:
    return {"w": np.full(BIG, step, np.float32), "v": np.arange(BIG, dtype=np.float32) + step}


def main(how: str, directory: str, marker: str) -> None:
    ckpt = jdp.checkpoint.Checkpointer(directory, async_save=True)
    ckpt.save(1, jdp.broadcast(values(1)))
    state = jdp.broadcast(values(2))
    ckpt.save(2, state)
    for leaf in state.values():
        leaf.delete()  # as a donating step would: the save must already hold its own copy
    if how == "sigterm":
        jdp.preempted()  # installs the SIGTERM handler, as a training loop's first call does
    with open(marker, "w") as f:
        f.write("saved")
    if how == "raise":
        raise RuntimeError("the training script fails right after save()")
    while how == "sigterm" and not jdp.preempted():
        time.sleep(0.01)


if __name__ == "__main__":
    main(*sys.argv[1:4])
