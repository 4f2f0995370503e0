"""The ways users import jdp, the classic form's aliases, and the layering the package keeps:
the launcher imports nothing numeric, and no module patches the import system."""
import ast
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, child_env, write_script

PACKAGE = pathlib.Path(REPO) / "jdp"
NUMERIC = {"jax", "jaxlib", "flax", "optax", "numpy"}


def test_import_jdp_gives_the_core_step():
    code = ("import jdp, jdp.core; "
            "assert jdp.train_step.__wrapped__ is jdp.core.train_step, jdp.train_step; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def one_sgd_step(x: np.ndarray, y: np.ndarray, lr: float) -> tuple:
    """(loss, new w) of w = 0 after one SGD step on mean((x @ w - y)^2), in plain numpy."""
    w = np.zeros((x.shape[1], 1))
    grad = 2.0 / len(x) * x.T @ (x @ w - y)
    return float(np.mean((x @ w - y) ** 2)), w - lr * grad


TRAIN = """
import jax.numpy as jnp, numpy as np, optax, jdp
x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(8, 2); y = x @ np.float32([[2], [-1]]) + 0.5
state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params={"w": jnp.zeros((2, 1))},
                                            tx=optax.sgd(0.1)))
loss_fn = lambda params, batch: jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
state, metrics = STEP(loss_fn)(state, jdp.shard({"x": x, "y": y}))
print(float(metrics["loss"]), *np.asarray(state.params["w"]).ravel())
"""
X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(8, 2)
Y = X @ np.float32([[2], [-1]]) + 0.5


@pytest.mark.parametrize("first_line,step", [
    ("import jdp.train_step", "jdp.train_step"),
    ("from jdp import train_step", "train_step"),
    ("import jdp", "jdp.train_step"),
])
def test_every_spelling_of_train_step_imports_and_trains(first_line, step):
    """The card's `import jdp.train_step` (first thing in a fresh interpreter), `from jdp import
    train_step` and plain `import jdp`: each trains one step on 2 devices as numpy's SGD does."""
    code = first_line + "\n" + TRAIN.replace("STEP", step)
    out = subprocess.run([sys.executable, "-c", code], env=child_env(devices=2), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    loss, *w = map(float, out.stdout.split())
    want_loss, want_w = one_sgd_step(X.astype(np.float64), Y.astype(np.float64), 0.1)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(w, want_w.ravel(), rtol=1e-5)


def test_jdp_train_step_is_one_callable_module_with_the_functions_signature():
    import inspect
    import types

    import jdp.train_step
    from jdp import train_step
    assert train_step is jdp.train_step and isinstance(train_step, types.ModuleType)
    assert callable(train_step) and train_step.__name__ == "jdp.train_step"
    assert inspect.signature(train_step) == inspect.signature(jdp.core.train_step)
    with pytest.raises(TypeError, match="unexpected keyword argument 'shard_everything'"):
        train_step(lambda p, b: 0.0, shard_everything=True)


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


NUMERIC_LOADED = ("import sys\n{first}\n"
                  "print(sorted({{name.split('.')[0] for name in sys.modules}} & set({numeric})))")


@pytest.mark.parametrize("first", ["import jdp.launch", "import jdp", "from jdp import launch, "
                                   "spawn, preempted", "import jdp.job"])
def test_the_launcher_and_the_front_door_import_nothing_numeric(first):
    """In a fresh interpreter, `import jdp` and the launcher's names leave JAX, flax, optax and
    numpy unimported: the supervisor starts in milliseconds and never holds an accelerator."""
    code = NUMERIC_LOADED.format(first=first, numeric=sorted(NUMERIC))
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-3000:])


def test_launch_help_imports_nothing_numeric():
    """`python -m jdp.launch --help` prints its manual; Python's own import log (-X importtime)
    names no numeric module."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "jdp.launch", "--help"],
                         env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--nproc_per_node" in out.stdout, out.stderr[-3000:]
    loaded = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()
              if line.startswith("import time:")}
    assert "jdp.launch" in loaded
    assert {name.split(".")[0] for name in loaded} & NUMERIC == set()


def test_the_supervisor_runs_a_job_without_importing_jax(tmp_path):
    """The launcher runs two ranks of a script to the end in-process, and after the job its own
    interpreter still holds no numeric module (the ranks import what their script imports)."""
    script = write_script(tmp_path, "hello.py", "import os; print('rank', os.environ['RANK'])\n")
    code = ("import sys\nfrom jdp.launch import main\n"
            f"try:\n    main(['--nproc_per_node', '2', {script!r}])\n"
            "except SystemExit as end:\n    print('exit', end.code)\n"
            "print(sorted({name.split('.')[0] for name in sys.modules} & "
            f"set({sorted(NUMERIC)})))")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert {"[rank0]: rank 0", "[rank1]: rank 1"} <= set(lines), out.stdout
    assert lines[-2:] == ["exit 0", "[]"], out.stdout


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
    (its own folder, or the cwd for `-m`), replacing the runner's own folder. The one line that
    reads sys.modules sets jdp.train_step's class (jdp/train_step.py)."""
    offenders = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
                 for path in sorted(PACKAGE.rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if "sys.path" in line or "sys.modules[" in line]
    assert len(offenders) == 2, offenders
    assert offenders[0].startswith("jdp/job/run.py:") and "sys.path[0] = os.getcwd() if " \
        "module else os.path.dirname(os.path.abspath(argv[0]))" in offenders[0], offenders
    # and the language reference's recipe for a module with a class of its own (a callable
    # jdp.train_step): sys.modules is read, never assigned
    assert offenders[1].startswith("jdp/train_step.py:") and offenders[1].endswith(
        "sys.modules[__name__].__class__ = CallableModule   # the reference's recipe: read, "
        "not assigned"), offenders


def test_the_version_has_one_source_and_a_changelog_section():
    """pyproject.toml reads the version from jdp.__version__, and CHANGELOG.md's newest released
    section is that version."""
    import jdp
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((pathlib.Path(REPO) / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "jdp.__version__"}
    newest = next(line for line in (pathlib.Path(REPO) / "CHANGELOG.md").read_text().splitlines()
                  if line.startswith("## ") and line != "## Unreleased")
    assert newest == f"## {jdp.__version__}", newest
    config = pytest.importorskip("setuptools.config.pyprojecttoml")
    built = config.read_configuration(pathlib.Path(REPO) / "pyproject.toml")
    assert built["project"]["version"] == jdp.__version__
