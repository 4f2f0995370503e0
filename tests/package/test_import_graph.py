"""jdp's floors, read from its source: no import circle between packages, no package reaching
into another's private module, the job's contract at the bottom and the launcher on top.

A package is a folder under jdp/ (`jdp.core`, `jdp.launch`, ...) or a top-level module
(`jdp.pmap`); `jdp` itself is the package's `__init__`, which re-exports the others. Every
import statement counts, at any depth (an import inside a function still ties the floors);
a module found by name at run time is not an import statement (the one: the runner imports
the spawn entry a `jdp.spawn` payload names, the launcher's own function).
`PYTHONPATH=tests python tests/package/test_import_graph.py` prints the floors with their lines of
code.
"""
import ast
import pathlib
import sys
from typing import NamedTuple

import pytest
from conftest import REPO

PACKAGE = pathlib.Path(REPO) / "jdp"


class Edge(NamedTuple):
    """One import of package `dst` by a file of package `src`."""
    src: str
    dst: str
    where: str        # "jdp/core/_step.py:20"
    what: str         # the dotted name imported, "jdp.distributed._group"


def package_of(module: str) -> str:
    """'core' for jdp.core._step, 'pmap' for jdp.pmap, 'jdp' for jdp itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "jdp"


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str, root: pathlib.Path) -> bool:
    """Whether `dotted` names a module or package under `root` (not a name inside one)."""
    base = root.parent.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imported(node: ast.AST, here: str, is_pkg: bool, root: pathlib.Path) -> list:
    """The dotted names an import statement brings in: modules, or `module.name`."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = here.split(".")
        anchor = anchor[:len(anchor) - node.level + (1 if is_pkg else 0)]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def edges(root: pathlib.Path = PACKAGE) -> list:
    """Every import of one jdp package by another, with the file and line it is on."""
    found = []
    for path in sorted(root.rglob("*.py")):
        here = module_name(path, root)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in imported(node, here, path.name == "__init__.py", root):
                if name.split(".")[0] != root.name:
                    continue
                # `from jdp.x import y`: the module jdp.x.y if there is one, else jdp.x's name y
                dst = package_of(name if is_module(name, root) or "." not in name
                                 else name.rsplit(".", 1)[0])
                if dst != package_of(here):
                    found.append(Edge(package_of(here), dst,
                                      f"{path.relative_to(root.parent)}:{node.lineno}", name))
    return found


def private_imports(found: list) -> list:
    """Imports of another package's private module or name (`jdp.x._y`, `jdp.pmap._z`)."""
    return [e for e in found
            if any(part.startswith("_") and not part.startswith("__")
                   for part in e.what.split(".")[2 if e.dst != "jdp" else 1:])]


def cycles(found: list) -> list:
    """Each circle between packages once, as the edges that close it."""
    graph: dict = {}
    for e in found:
        graph.setdefault(e.src, {}).setdefault(e.dst, e)
    circles, seen = [], set()

    def walk(start, node, trail):
        for nxt, edge in sorted(graph.get(node, {}).items()):
            if nxt == start:
                key = frozenset(e.src for e in trail + [edge])
                if key not in seen:
                    seen.add(key)
                    circles.append(trail + [edge])
            elif nxt not in {e.src for e in trail} | {node}:
                walk(start, nxt, trail + [edge])

    for start in sorted(graph):
        walk(start, start, [])
    return circles


def floors(found: list) -> dict:
    """Package -> floor, counted down from the roof (`jdp`, 0): one below the lowest package
    that imports it. What nothing but `jdp` imports sits on floor 1, the top floor."""
    importers: dict = {}
    for e in found:
        importers.setdefault(e.dst, set()).add(e.src)
    memo: dict = {"jdp": 0}

    def floor(pkg, trail=()):
        if pkg not in memo:
            if pkg in trail:
                raise ValueError(f"a circle through {' <- '.join(trail + (pkg,))}")
            memo[pkg] = 1 + max((floor(i, trail + (pkg,)) for i in importers.get(pkg, ())),
                                default=0)
        return memo[pkg]

    packages = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
                if p.suffix == ".py" and p.stem != "__init__" or (p / "__init__.py").is_file()}
    return {pkg: floor(pkg) for pkg in sorted(packages | set(importers) | {"jdp"})}


def describe(edge_list: list) -> str:
    return "; ".join(f"{e.src} -> {e.dst} ({e.where}: {e.what})" for e in edge_list)


def test_no_import_circle_between_packages():
    circles = cycles(edges())
    assert circles == [], "import circles: " + " | ".join(describe(c) for c in circles)


def test_no_package_imports_another_packages_private_module():
    offenders = private_imports(edges())
    assert offenders == [], "private imports across packages: " + describe(offenders)


def test_the_launcher_is_imported_only_by_the_top_level_re_export():
    offenders = [e for e in edges() if e.dst == "launch" and e.src != "jdp"]
    assert offenders == [], "jdp.launch imported from inside jdp: " + describe(offenders)


def test_the_pmap_form_is_on_top_of_the_core():
    """Only `jdp` imports the classic form, so removing jdp/pmap.py breaks the classic form alone;
    the layout it plugs into the core is there once a numeric name of `jdp` has been read."""
    import jdp
    offenders = [e for e in edges() if e.dst == "pmap" and e.src != "jdp"]
    assert offenders == [], "jdp.pmap imported from inside jdp: " + describe(offenders)
    assert jdp.core.layouts.names() == ("global", "pmap")
    assert jdp.core.layouts.named("pmap").shard is jdp.pmap.shard


def test_a_layout_plugged_in_needs_a_name_of_its_own():
    import jdp
    with pytest.raises(ValueError, match="expected a Layout whose name is not 'global'"):
        jdp.core.layouts.register(jdp.core.layouts.named("pmap")._replace(name="global"))
    with pytest.raises(ValueError, match=r"layout='stacked'; expected one of \('global', 'pmap'\)"):
        jdp.core.layouts.named("stacked")


def test_the_jobs_contract_is_the_bottom_floor_and_the_launcher_is_on_top():
    found = edges()
    from_job = [e for e in found if e.src == "job"]
    assert from_job == [], "jdp.job imports another package: " + describe(from_job)
    levels = floors(found)
    assert levels["launch"] == 1, levels
    assert levels["job"] == max(levels.values()), levels


def test_the_spmd_floor_sits_below_the_step_floor_and_imports_no_job():
    """The step's math (`jdp.spmd`) imports nothing of jdp but the job contract's value checks
    (standard library, no job state), so it runs and is tested without a job; the step floor
    (`jdp.core`) builds on it."""
    found = edges()
    from_spmd = [e for e in found if e.src == "spmd" and e.what != "jdp.job.values"]
    assert from_spmd == [], "jdp.spmd imports above its floor: " + describe(from_spmd)
    levels = floors(found)
    assert levels["spmd"] > levels["core"], levels


def test_the_checker_names_a_circle_and_a_private_import(tmp_path):
    """The checks above would see a violation: a made-up package with both, named edge by edge."""
    root = tmp_path / "jdp"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "__init__.py").write_text("from jdp import a, b\n")
    (root / "a" / "__init__.py").write_text("from jdp.a._x import f\n")
    (root / "a" / "_x.py").write_text("def f():\n    from jdp.b import g\n    return g\n")
    (root / "b" / "__init__.py").write_text("from jdp.b._y import g\n")
    (root / "b" / "_y.py").write_text("from jdp.a import _x\n\ng = 1\n")
    found = edges(root)
    assert [describe(c) for c in cycles(found)] == [
        "a -> b (jdp/a/_x.py:2: jdp.b.g); b -> a (jdp/b/_y.py:1: jdp.a._x)"]
    assert describe(private_imports(found)) == "b -> a (jdp/b/_y.py:1: jdp.a._x)"


def lines_of(pkg: str) -> int:
    paths = [PACKAGE / f"{pkg}.py"] if (PACKAGE / f"{pkg}.py").is_file() else (
        sorted((PACKAGE / pkg).rglob("*.py")) if pkg != "jdp" else [PACKAGE / "__init__.py"])
    return sum(len(p.read_text().splitlines()) for p in paths)


if __name__ == "__main__":
    levels = floors(edges())
    for level in sorted(set(levels.values())):
        pkgs = [f"{p} ({lines_of(p)})" for p, lv in levels.items() if lv == level]
        print(f"floor {level}: {', '.join(pkgs)}", file=sys.stdout)
