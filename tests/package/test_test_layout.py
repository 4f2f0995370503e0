"""The tests' own layout: unit tests in tests/<package>/, whatever starts processes in
tests/system/ (marked `system`, left out by `make test-fast`), every test folder on pytest's
import path with no two modules of one name, so tests share helpers by module name."""
import pathlib
import re

import pytest
from conftest import REPO

TESTS = pathlib.Path(REPO) / "tests"
# what starts a process: a subprocess, the launcher, jdp.spawn, mpirun or srun
STARTS = re.compile(r"subprocess\.|\bPopen\b|run_python\(|run_ranks\(|start_launcher\(|"
                    r"start_group\(|jdp\.spawn\(|\bspawn\(|mpirun|\bsrun\b|\"jdp\.launch\"")


def modules() -> list:
    """Every Python module under tests/ but the doubles and the Kubernetes pod shim."""
    return [p for p in sorted(TESTS.rglob("*.py"))
            if p.parent != TESTS and "doubles" not in p.parts and "_k8s_pod" not in p.parts]


def test_no_two_test_modules_share_a_name():
    names = [p.name for p in modules()]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_every_test_folder_is_on_the_import_path():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((pathlib.Path(REPO) / "pyproject.toml").read_text())
    path = set(config["tool"]["pytest"]["ini_options"]["pythonpath"])
    folders = {p.parent.relative_to(REPO).as_posix() for p in modules()}
    assert folders - path == set()


def test_what_starts_processes_is_under_system_and_nothing_else_is():
    """A test module that starts processes lies in tests/system/; a unit test module does not."""
    tests = [p for p in modules()   # this file names the signs, it does not start anything
             if p.name.startswith("test_") and p.resolve() != pathlib.Path(__file__).resolve()]
    system = TESTS / "system"
    misplaced = [p.relative_to(TESTS).as_posix() for p in tests
                 if bool(STARTS.search(p.read_text())) != (system in p.parents)]
    assert misplaced == []
