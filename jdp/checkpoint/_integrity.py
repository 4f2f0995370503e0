"""Integrity records of checkpoints: what each array was at save, checked at restore.

orbax and tensorstore check neither the bytes of an array nor that every file is present: a few
bytes overwritten inside a data file restore as wrong numbers, and a truncated or deleted file
fails 20 frames deep in tensorstore. So every checkpoint carries a small JSON record (the
`integrity` item) with each array's shape, dtype and CRC32 of its bytes, computed on the host
from the logical value (one copy, whatever the layout), plus a CRC32 of the loader position.
A restore compares what it read against the record, and every read failure becomes `Damaged`,
naming the file or the array, so that the Checkpointer can fall back to an older checkpoint.
"""
from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np

FORMAT = 1
RECORD_FILE = "integrity/metadata"  # where orbax's JsonSave puts the record inside a step


class Damaged(Exception):
    """A checkpoint's files are missing, unreadable or differ from its integrity record."""


class CorruptCheckpointError(ValueError):
    """Raised by `Checkpointer.restore(step=k)` when checkpoint k fails verification."""


def crc32(value: np.ndarray) -> int:
    """CRC32 of an array's bytes in C order (any dtype, 0-d included)."""
    return zlib.crc32(np.ascontiguousarray(value).reshape(-1).view(np.uint8))


def position_crc32(position: Any) -> int | None:
    """CRC32 of a loader position's canonical JSON (None when there is none)."""
    if position is None:
        return None
    return zlib.crc32(json.dumps(position, sort_keys=True).encode())


def record(values: Iterable[tuple[str, np.ndarray]], position: Any) -> dict:
    """The integrity record of one checkpoint: {name: shape, dtype, crc32} + the loader's.

    `values` may be a generator: each host value is dropped once summed, so a large state
    never sits on the host whole just to be checksummed.
    """
    arrays = {name: {"shape": list(v.shape), "dtype": str(v.dtype), "crc32": crc32(v)}
              for name, v in values}
    return {"format": FORMAT, "arrays": arrays, "loader_crc32": position_crc32(position)}


def checked_record(data: Any) -> dict:
    """`data` if it is a well-formed record; Damaged otherwise."""
    if not (isinstance(data, dict) and data.get("format") == FORMAT
            and isinstance(data.get("arrays"), dict) and "loader_crc32" in data
            and all(_entry_ok(e) for e in data["arrays"].values())):
        raise Damaged(f"{RECORD_FILE}: not a jdp integrity record (format {FORMAT})")
    return data


def _entry_ok(entry: Any) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("shape"), list)
            and all(isinstance(n, int) for n in entry["shape"])
            and isinstance(entry.get("dtype"), str) and isinstance(entry.get("crc32"), int))


def verify(name: str, value: np.ndarray, entry: dict) -> None:
    """Damaged unless `value` is what the record says array `name` was at save."""
    got = (list(value.shape), str(value.dtype), crc32(value))
    want = (entry["shape"], entry["dtype"], entry["crc32"])
    if got != want:
        raise Damaged(f"array {name}: read {_describe(got)}, saved {_describe(want)}")


def verify_position(position: Any, want: int | None) -> None:
    """Damaged unless the loader position read back is the one saved."""
    got = position_crc32(position)
    if got != want:
        raise Damaged(f"loader position: CRC32 {got} read, {want} saved")


def from_error(error: BaseException, step_dir: str, what: str) -> Damaged:
    """A read failure of `what` in `step_dir` as Damaged naming the file, in one line."""
    text = " ".join(str(error).split())
    files = re.findall(re.escape(step_dir.rstrip("/")) + r"/([^\s'\"\]\),;:]+)", text)
    where = max(files, key=len).rstrip(".") if files else what  # the most specific file
    return Damaged(f"{where}: {type(error).__name__}: {text[:300]}")


def _describe(info: tuple) -> str:
    shape, dtype, crc = info
    return f"shape {tuple(shape)} {dtype} CRC32 {crc:#010x}"


def check_structure(saved: dict, found: list, step: int) -> None:
    """ValueError naming the first leaf where checkpoint `step` and the state differ."""
    where = f"Checkpointer.restore: checkpoint {step} does not match the state"
    for leaf in found:
        entry = saved.get(leaf.name)
        if entry is None:
            raise ValueError(f"{where}: missing in checkpoint: {leaf.name} (state has shape "
                             f"{leaf.shape}). Restore into a state built like the one saved")
        if tuple(entry["shape"]) != leaf.shape:
            raise ValueError(f"{where}: {leaf.name}: checkpoint has shape "
                             f"{tuple(entry['shape'])}, state has {leaf.shape}")
        if entry["dtype"] != str(leaf.dtype):
            raise ValueError(f"{where}: {leaf.name}: checkpoint has dtype {entry['dtype']}, "
                             f"state has {leaf.dtype}. Restore into a state of the saved "
                             "dtypes, then cast")
    extra = sorted(set(saved) - {leaf.name for leaf in found})
    if extra:
        raise ValueError(f"{where}: in checkpoint but not in state: {extra[0]}. Restore into a "
                         "state built like the one saved")
