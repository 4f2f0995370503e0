"""Processes for test_checkpoint_concurrency.py (beside it): a trainer that saves every step and
a reader that watches the same directory.

Run as
`python tests/system/checkpoint/_checkpoint_concurrency_child.py trainer|reader DIRECTORY OUT
SECONDS`.
Every value of the state saved at step k encodes k, so the reader checks what it restored
without asking the trainer.
"""
import json
import sys
import time
import traceback
import warnings

import jax
import numpy as np

import jdp
from jdp.core import replicated

SHAPES = {"w1": (128, 256), "b1": (256,), "w2": (256, 10), "b2": (10,)}  # an MLP, 35k params


# A training step's compute between saves. Saving back to back with max_to_keep=3, a reader
# slowed by a loaded machine lost every checkpoint it started to read before it finished
# (CorruptCheckpointError after 20 tries, as designed): no trainer saves that often.
STEP_S = 0.05


def values(step: int) -> dict:
    """The state saved at `step`: leaf i holds step + i*0.25 + its flat index * 1e-3."""
    out = {name: (step + i * 0.25 + np.arange(np.prod(shape)) * 1e-3).astype(np.float32)
           .reshape(shape) for i, (name, shape) in enumerate(SHAPES.items())}
    out["step"] = np.int32(step)
    return out


def to_global(tree):
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x), replicated()), tree)


def trainer(directory: str, out: str, seconds: float) -> None:
    """Save steps 1, 2, ... until `seconds` have passed; report saves and failures."""
    ckpt = jdp.checkpoint.Checkpointer(directory, max_to_keep=3)
    result, step, start = {"saved": 0, "failures": [], "save_s": []}, 0, time.monotonic()
    while time.monotonic() - start < seconds:
        step += 1
        state = to_global(values(step))
        began = time.monotonic()
        try:
            ckpt.save(step, state)
            result["saved"] += 1
            result["save_s"].append(time.monotonic() - began)
        except Exception:  # every failed save is the test's failure: keep going, count it
            result["failures"].append(traceback.format_exc())
        time.sleep(STEP_S)
    result["last_step"] = step
    with open(out, "w") as f:
        json.dump(result, f)


def reader(directory: str, out: str, seconds: float) -> None:
    """Open Checkpointers, list, restore and check, until `seconds` have passed."""
    template = to_global(jax.tree.map(np.zeros_like, values(0)))
    result = {"restores": 0, "empty": 0, "latest_calls": 0, "wrong": [], "errors": [],
              "warnings": [], "restore_s": [], "steps": [], "raced": 0}
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            ckpt = jdp.checkpoint.Checkpointer(directory, max_to_keep=3)
            latest = ckpt.latest_step()
            result["latest_calls"] += 1
            began = time.monotonic()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                state = ckpt.restore(template)
            result["warnings"] += [str(w.message) for w in caught]
            if state is template:
                result["empty"] += 1
                continue
            result["restore_s"].append(time.monotonic() - began)
            result["restores"] += 1
            step = int(np.asarray(state["step"]))
            result["steps"].append(step)
            want = values(step)
            # latest None: the first save landed between the listing and the restore
            if latest is not None and step < latest - 3 or any(
                    np.asarray(state[k]).tobytes() != want[k].tobytes() for k in want):
                result["wrong"].append({"step": step, "latest": latest})
        except jdp.checkpoint.CorruptCheckpointError as e:
            if "deleted while being read" not in str(e):
                raise
            result["raced"] += 1   # the writer outran this reader 20 times: it says retry
        except Exception:
            result["errors"].append(traceback.format_exc())
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    mode, directory, out, seconds = sys.argv[1:5]
    {"trainer": trainer, "reader": reader}[mode](directory, out, float(seconds))
