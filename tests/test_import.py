"""The ways users import jdp, the classic form's aliases, and the layering the package keeps:
the launcher imports nothing numeric, and no module patches the import system."""
import ast
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, child_env

PACKAGE = pathlib.Path(REPO) / "jdp"
NUMERIC = {"jax", "jaxlib", "flax", "optax", "numpy"}


def test_import_jdp_gives_the_core_step():
    code = ("import jdp, jdp.core; "
            "assert jdp.train_step is jdp.core.train_step, jdp.train_step; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_every_public_name_is_exported():
    import jdp
    missing = [name for name in jdp.__all__ if not hasattr(jdp, name)]
    assert missing == []
    for name in ("broadcast", "mesh", "preempted", "train_step", "eval_step", "replicate",
                 "unshard", "pmap"):
        assert name in jdp.__all__


def test_the_classic_top_level_names_are_the_pmap_forms():
    import jdp
    assert jdp.replicate is jdp.pmap.replicate
    assert jdp.unreplicate is jdp.pmap.unreplicate


def test_shard_with_layout_pmap_is_the_pmap_forms_shard():
    import jax

    import jdp
    rows = {"x": np.arange(16 * 3, dtype=np.float32).reshape(16, 3), "m": np.arange(16) < 13}
    alias, classic = jdp.shard(rows, layout="pmap"), jdp.pmap.shard(rows)
    for a, c in zip(jax.tree.leaves(alias), jax.tree.leaves(classic), strict=True):
        assert a.shape == c.shape == (jax.local_device_count(), 16 // jax.local_device_count(),
                                      *c.shape[2:])
        assert a.sharding == c.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def imported_modules(path: pathlib.Path) -> set:
    """Top-level names of every module `path` imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted([*(PACKAGE / "launch").glob("*.py"),
                                         *(PACKAGE / "job").glob("*.py")]),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_launcher_imports_nothing_numeric(path):
    """The launcher supervises ranks; it must start fast and never hold an accelerator."""
    assert imported_modules(path) & NUMERIC == set()


def test_no_module_patches_the_import_system():
    """No sys.modules edits, no import-path tricks. The one line that sets sys.path is the rank
    runner's: it gives the user's script the first import-path entry `python script.py` would
    (its own folder, or the cwd for `-m`), replacing the runner's own folder."""
    offenders = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
                 for path in sorted(PACKAGE.rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if "sys.path" in line or "sys.modules[" in line]
    assert len(offenders) == 1, offenders
    assert offenders[0].startswith("jdp/job/run.py:") and "sys.path[0] = os.getcwd() if " \
        "module else os.path.dirname(os.path.abspath(argv[0]))" in offenders[0], offenders
