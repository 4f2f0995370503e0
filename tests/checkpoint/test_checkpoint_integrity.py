"""A damaged checkpoint is never restored silently: restore() skips it with a warning naming
the file or array and loads the newest intact one; restore(step=k) raises naming it."""
import os
import warnings
import zlib

import numpy as np
import orbax.checkpoint as ocp
import pytest
from _checkpoint_child import global_state

import jdp
from jdp.checkpoint import Checkpointer, CorruptCheckpointError


def values(step):
    """A state whose every value encodes `step` (4,096 weights, as in the issue's report)."""
    rng = np.random.default_rng(step)
    return {"w": rng.normal(size=(64, 64)).astype(np.float32),
            "b": np.full(64, step, np.float32), "count": np.int32(step)}


def state(step, layout="stacked"):
    return jdp.replicate(values(step)) if layout == "stacked" else global_state(values(step))


def saved_twice(directory, layout="stacked"):
    """Checkpoints 1 and 2, both intact: the damage tests break 2."""
    ckpt = Checkpointer(directory)
    ckpt.save(1, state(1, layout))
    ckpt.save(2, state(2, layout))
    return ckpt


def data_files(step_dir):
    """The array data files of a step (ocdbt's d/ files), largest first."""
    found = [os.path.join(d, f) for d, _, files in os.walk(step_dir / "state")
             for f in files if os.path.basename(d) == "d"]
    return sorted(found, key=os.path.getsize, reverse=True)


def overwrite_bytes(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\xde\xad\xbe\xef")


def truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


def assert_equal_to(restored, step):
    for key, want in values(step).items():
        got = np.asarray(restored[key])
        assert got.shape[1:] == np.shape(want) and (got == want).all(), (key, step)


def fallback_restore(ckpt, like=None):
    """restore() of the newest checkpoint, returning (state, the Checkpointer's warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = ckpt.restore(state(0) if like is None else like)
    return restored, [str(w.message) for w in caught if w.category is RuntimeWarning
                      and str(w.message).startswith("Checkpointer.")]   # not asyncio's


@pytest.mark.parametrize("damage", [overwrite_bytes, truncate], ids=["overwritten", "truncated"])
def test_damaged_data_falls_back_to_the_previous_checkpoint_with_a_warning(tmp_path, damage):
    ckpt = saved_twice(tmp_path)
    for path in data_files(tmp_path / "2"):
        damage(path)
    restored, warned = fallback_restore(ckpt)
    assert_equal_to(restored, 1)
    assert len(warned) == 1 and f"checkpoint 2 in {tmp_path} is damaged" in warned[0]
    with pytest.raises(CorruptCheckpointError, match=r"checkpoint 2 .* is damaged: (array|state/)"):
        ckpt.restore(state(0), step=2)


def test_four_bytes_overwritten_in_one_data_file_are_found(tmp_path):
    ckpt = saved_twice(tmp_path)
    overwrite_bytes(data_files(tmp_path / "2")[0])  # the largest: it holds w
    with pytest.raises(CorruptCheckpointError) as info:
        ckpt.restore(state(0), step=2)
    message = str(info.value)
    assert "\n" not in message
    assert "array w:" in message or "state/ocdbt.process_0/d/" in message, message
    assert_equal_to(fallback_restore(ckpt)[0], 1)


@pytest.mark.parametrize("name", ["state/_METADATA", "state/manifest.ocdbt",
                                  "state/ocdbt.process_0/manifest.ocdbt", "integrity/metadata",
                                  "_CHECKPOINT_METADATA", "state/_sharding"])
def test_a_deleted_metadata_file_never_restores_wrong_values(tmp_path, name):
    ckpt = saved_twice(tmp_path, "global")
    os.remove(tmp_path / "2" / name)
    restored, warned = fallback_restore(ckpt)
    if warned:  # orbax needs the file: the checkpoint is reported and skipped
        assert_equal_to(restored, 1)
        assert "checkpoint 2" in warned[0], warned
    else:  # orbax does without it: every array still verified equal to what was saved
        assert_equal_to(restored, 2)


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path):
    ckpt = saved_twice(tmp_path)
    for step in (1, 2):
        os.remove(tmp_path / str(step) / "integrity" / "metadata")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CorruptCheckpointError, match="no intact checkpoint .* 2: .* 1: "):
            ckpt.restore(state(0))


def test_a_damaged_loader_position_is_found(tmp_path):
    loader = jdp.data.Loader({"x": np.arange(32, dtype=np.float32)}, batch_size=8)
    ckpt = Checkpointer(tmp_path)
    batches = iter(loader)   # two batches taken (a lone next(iter(loader)) is a peek: it
    next(batches)            # gives its batch back)
    next(batches)
    ckpt.save(1, state(1), loader=loader)
    path = tmp_path / "1" / "loader" / "metadata"
    path.write_text(path.read_text().replace('"step": 2', '"step": 3'))
    assert '"step": 3' in path.read_text()
    fresh = jdp.data.Loader({"x": np.arange(32, dtype=np.float32)}, batch_size=8)
    with pytest.raises(CorruptCheckpointError, match="loader position"):
        ckpt.restore(state(0), loader=fresh, step=1)
    assert (fresh.epoch, fresh.step) == (0, 0)


def test_a_mangled_integrity_record_is_damage_not_a_crash(tmp_path):
    ckpt = saved_twice(tmp_path)
    path = tmp_path / "2" / "integrity" / "metadata"
    path.write_text(path.read_text().replace('"shape"', '"shap"'))
    restored, warned = fallback_restore(ckpt)
    assert_equal_to(restored, 1)
    assert len(warned) == 1 and "integrity/metadata: not a jdp integrity record" in warned[0]


def save_format_1(directory, step, tree, damaged=None):
    """Checkpoint `step` as jdp wrote it before integrity format 2: orbax's JsonSave of a record
    holding a host CRC32 of each array's bytes (off by one for the array named `damaged`)."""
    arrays = {name: {"shape": list(np.shape(v)), "dtype": str(np.asarray(v).dtype),
                     "crc32": zlib.crc32(np.ascontiguousarray(v).reshape(-1).view(np.uint8))
                     ^ (name == damaged)} for name, v in tree.items()}
    record = {"format": 1, "arrays": arrays, "loader_crc32": None}
    manager = ocp.CheckpointManager(directory)
    manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree),
                                               integrity=ocp.args.JsonSave(record)))
    manager.close()


@pytest.mark.parametrize("layout", ["stacked", "global"])
def test_checkpoints_of_integrity_format_1_restore_and_are_verified(tmp_path, layout):
    save_format_1(tmp_path, 1, values(1))
    save_format_1(tmp_path, 2, values(2), damaged="w")
    ckpt = Checkpointer(tmp_path)
    assert ckpt.all_steps() == [1, 2]
    restored, warned = fallback_restore(ckpt, state(0, layout))
    assert_equal_to(jdp.pmap.like(state(0), jdp.pmap.to_global(restored)), 1)  # stacked, to compare
    assert len(warned) == 1 and "checkpoint 2" in warned[0] and "array w: read hash" in warned[0]
    with pytest.raises(CorruptCheckpointError, match="checkpoint 2 .* is damaged: array w"):
        ckpt.restore(state(0, layout), step=2)
    ckpt.save(3, state(3, layout))  # a format-2 checkpoint beside them
    for step in (3, 1):
        restored = ckpt.restore(state(0, layout), step=step)
        assert_equal_to(jdp.pmap.like(state(0), jdp.pmap.to_global(restored)), step)
