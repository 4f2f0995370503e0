"""Integrity records of checkpoints: what each array was at save, checked at restore.

orbax checks neither an array's bytes nor that every file is present: overwritten bytes restore
as wrong numbers, a truncated file fails deep inside tensorstore. So each checkpoint has an
`integrity` item: process 0's record of every array's logical shape and dtype and the loader
position's CRC32, and from every process a 32-bit hash of the shards it holds the first copy of.
An array's hash sums (mod 2**32) a bijective mix of each element's bits and position: one changed
element changes it, and the partial sums over any sharding add up to the same number. So devices
hash each shard where it lives and the (background) write fetches the sums: no host copy, no
cross-process gather. A restore hashes what it read, in any sharding, and compares; every read
failure becomes `Damaged`, naming the file or the array, and the Checkpointer falls back.
Records of format 1 (jdp's first) hold a host CRC32 per array instead; restore still checks them.
"""
from __future__ import annotations

import functools
import json
import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec

from jdp.core import AXIS, mesh, replicated

FORMAT = 2
RECORD_FILE = "integrity/metadata"  # process 0's record; process i adds metadata.process_i


class Damaged(Exception):
    """A checkpoint's files are missing, unreadable or differ from its integrity record."""


class CorruptCheckpointError(ValueError):
    """Raised by `Checkpointer.restore(step=k)` when checkpoint k fails verification."""


def position_crc32(position: Any) -> int | None:
    """CRC32 of a loader position's canonical JSON (None when there is none)."""
    if position is None:
        return None
    return zlib.crc32(json.dumps(position, sort_keys=True).encode())


def record(found: list, position: Any) -> dict:
    """Process 0's record without hashes; "processes" counts the records that complete it."""
    arrays = {leaf.name: {"shape": list(leaf.shape), "dtype": str(leaf.dtype)} for leaf in found}
    return {"format": FORMAT, "arrays": arrays, "loader_crc32": position_crc32(position),
            "processes": jax.process_count()}


def hashes(found: list, values: list) -> jax.Array:
    """Dispatch the hashes of `values` (the arrays of `found`, in order): [devices, leaves],
    row d the partial hashes of what device d holds the first copy of. Returns at once."""
    m = mesh()
    values = [v if isinstance(v, jax.Array) and getattr(v.sharding, "mesh", None) == m
              else jax.device_put(v, replicated()) for v in values]
    return _device_hashes(tuple(values), tuple(v.sharding.spec for v in values),
                          tuple(leaf.shape for leaf in found))


def process_sums(names: list[str], partial: jax.Array,
                 every_process: bool = False) -> dict[str, int]:
    """{name: this process's share of the array's hash} from `hashes` (waits for it); with
    `every_process`, the whole hash (a collective: every process calls it)."""
    rows = sum(np.asarray(s.data, np.uint64).sum(0) for s in partial.addressable_shards)
    if every_process and jax.process_count() > 1:
        rows = np.asarray(multihost_utils.process_allgather(rows % 2**32)).sum(0)
    return {n: int(h) % 2**32 for n, h in zip(names, rows, strict=True)}


@functools.partial(jax.jit, static_argnums=(1, 2))
def _device_hashes(values: tuple, specs: tuple, shapes: tuple) -> jax.Array:
    def per_device(*blocks):
        d = lax.axis_index(AXIS)
        out = []
        for block, spec, shape in zip(blocks, specs, shapes, strict=True):
            split = [i for i, axis in enumerate(spec) if axis is not None]
            start = [d * block.shape[i] if i in split else 0 for i in range(block.ndim)]
            one = functools.partial(_block_hash, block, start, shape)
            # A replicated array's first copy is device 0's: only it hashes.
            out.append(one() if split else lax.cond(d == 0, one, lambda: jnp.uint32(0)))
        return jnp.stack(out)[None] if out else jnp.zeros((1, 0), jnp.uint32)

    return jax.shard_map(per_device, mesh=mesh(), in_specs=specs,
                         out_specs=PartitionSpec(AXIS))(*values)


def _block_hash(block: jax.Array, start: list, shape: tuple) -> jax.Array:
    """Sum of mix(bits, position) over a block's elements inside the logical `shape` (ZeRO's
    padding rows left out); `start` is the block's offset in the array."""
    words = _words(block).reshape(*block.shape, -1)
    index, inside, stride = jnp.uint32(0), jnp.bool_(True), 1
    for k in reversed(range(block.ndim)):
        at = lax.broadcasted_iota(jnp.uint32, block.shape, k) + jnp.uint32(start[k])
        index, inside = index + at * jnp.uint32(stride), inside & (at < shape[k])
        stride = stride * shape[k] % 2**32
    key = index[..., None] * jnp.uint32(words.shape[-1]) + lax.broadcasted_iota(
        jnp.uint32, words.shape, words.ndim - 1)
    mixed = _fmix(words ^ _fmix(key + jnp.uint32(0x9E3779B9)))
    return jnp.sum(jnp.where(inside[..., None], mixed, jnp.uint32(0)), dtype=jnp.uint32)


def _words(x: jax.Array) -> jax.Array:
    """The bits of each element as uint32 words, `[..., words]` (or `[...]`: one word)."""
    if jnp.iscomplexobj(x):
        x = jnp.stack([x.real, x.imag], -1)
    x = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    unsigned = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _fmix(h: jax.Array) -> jax.Array:
    """murmur3's finaliser: a bijection of uint32 in which each input bit moves every output bit."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def checked(records: list) -> dict:
    """Process 0's record with "hashes" the sum of every process's (format 1: the CRC32s);
    Damaged if malformed."""
    first = records[0]
    old = isinstance(first, dict) and first.get("format") == 1
    if not (isinstance(first, dict) and first.get("format") in (1, FORMAT)
            and isinstance(first.get("arrays"), dict) and "loader_crc32" in first
            and all(isinstance(e, dict) and isinstance(e.get("shape"), list)
                    and all(isinstance(n, int) for n in e["shape"])
                    and isinstance(e.get("dtype"), str)
                    and (not old or isinstance(e.get("crc32"), int))
                    for e in first["arrays"].values())
            and (old or all(isinstance(r, dict) and isinstance(r.get("hashes"), dict)
                            for r in records))):
        raise Damaged(f"{RECORD_FILE}: not a jdp integrity record (format 1 or {FORMAT})")
    if old:
        return {**first, "hashes": {n: e["crc32"] for n, e in first["arrays"].items()}}
    total = {name: sum(r["hashes"].get(name, 0) for r in records) % 2**32
             for name in first["arrays"]}
    return {**first, "hashes": total}


def verify(found: list, values: list, position: Any, record: dict) -> None:
    """Damaged naming the first array (or the loader position, if read) that differs from
    the record; a collective: every process calls it."""
    names = [leaf.name for leaf in found]
    got = (_host_crc32s(found, values) if record["format"] == 1
           else process_sums(names, hashes(found, values), every_process=True))
    for name in names:
        if got[name] != record["hashes"][name]:
            raise Damaged(f"array {name}: read hash {got[name]:#010x}, saved "
                          f"{record['hashes'][name]:#010x}")
    if position is not None and position_crc32(position) != record["loader_crc32"]:
        raise Damaged(f"loader position: CRC32 {position_crc32(position)} read, "
                      f"{record['loader_crc32']} saved")


def _host_crc32s(found: list, values: list) -> dict[str, int]:
    """Format 1's checksums: {name: CRC32 of the logical value's bytes}, on the host (a
    collective for arrays sharded over processes)."""
    out = {}
    for leaf, value in zip(found, values, strict=True):
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            value = multihost_utils.process_allgather(value, tiled=True)
        value = np.ascontiguousarray(np.asarray(value)[tuple(slice(0, n) for n in leaf.shape)])
        out[leaf.name] = zlib.crc32(value.reshape(-1).view(np.uint8))
    return out


def from_error(error: BaseException, step_dir: str, what: str) -> Damaged:
    """A read failure of `what` in `step_dir` as Damaged naming the file, in one line."""
    text = " ".join(str(error).split())
    files = re.findall(re.escape(step_dir.rstrip("/")) + r"/([^\s'\"\]\),;:]+)", text)
    where = max(files, key=len).rstrip(".") if files else what  # the most specific file
    return Damaged(f"{where}: {type(error).__name__}: {text[:300]}")


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
