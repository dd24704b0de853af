"""``workloads/`` is grouped by job and its imports point one way (the picture in
``workloads/__init__.py``): load <- measure <- reports <- comparisons; sim over reports and
measure; microbench over measure. Its top level holds only the commands' thin aliases, and
every documented ``python -m workloads.X`` still names a module."""

import ast
import importlib.util
import re

import pytest

from tests.unit.test_layers import ROOT, _imports

pytestmark = pytest.mark.unit

WORKLOADS = ROOT / "workloads"
#: subpackage -> the subpackages it may import directly (and, through them, what they may)
EDGES = {
    "load": (),
    "measure": ("load",),
    "reports": ("measure",),
    "comparisons": ("reports",),
    "sim": ("reports", "measure"),
    "microbench": ("measure",),
}


def _reach(package: str) -> set[str]:
    """Every subpackage ``package`` may import: its edges' closure."""
    seen: set[str] = set()
    todo = list(EDGES[package])
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += EDGES[name]
    return seen


def _workloads_targets(path) -> set[str]:
    """The top-level names under ``workloads.`` that ``path`` imports (``load``, ``client``)."""
    return {name.split(".")[1] for name in _imports(path) if name.startswith("workloads.")}


def test_the_subpackages_are_the_ones_in_the_picture():
    found = sorted(p.parent.name for p in WORKLOADS.glob("*/__init__.py"))
    assert found == sorted(EDGES), found


def test_the_layers_have_no_cycle():
    assert all(package not in _reach(package) for package in EDGES)


@pytest.mark.parametrize("package", sorted(EDGES))
def test_imports_point_one_way(package):
    allowed = _reach(package) | {package}
    bad = [
        f"{path.relative_to(ROOT)} imports workloads.{target}"
        for path in sorted((WORKLOADS / package).rglob("*.py"))
        for target in sorted(_workloads_targets(path) - allowed)
    ]
    assert not bad, bad


def _alias_target(path) -> str:
    """The module a top-level alias runs; fails unless ``path`` is only an alias."""
    body = ast.parse(path.read_text()).body
    assert len(body) == 3, f"{path.name}: docstring, one import, the __main__ guard"
    doc, imp, guard = body
    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), path.name
    assert isinstance(imp, ast.ImportFrom) and [a.name for a in imp.names] == ["main"], path.name
    assert isinstance(guard, ast.If) and ast.unparse(guard.test) == "__name__ == '__main__'"
    return imp.module


def test_the_top_level_holds_only_aliases_of_subpackage_commands():
    aliases = sorted(p for p in WORKLOADS.glob("*.py") if p.name != "__init__.py")
    assert aliases
    for path in aliases:
        target = _alias_target(path)
        assert target.split(".")[:1] == ["workloads"] and target.split(".")[1] in EDGES, target
        spec = importlib.util.find_spec(target)
        assert spec is not None and spec.origin, target
        assert "def main(" in open(spec.origin).read(), f"{target} has no main()"


def test_library_code_never_imports_an_alias():
    aliases = {p.stem for p in WORKLOADS.glob("*.py")} - {"__init__"}
    bad = [
        f"{path.relative_to(ROOT)} imports workloads.{target}"
        for top in ("workloads", "tests", "flying", "scheduler", "sglang_patches")
        for path in sorted((ROOT / top).rglob("*.py"))
        if path.parent != WORKLOADS
        for target in sorted(_workloads_targets(path) & aliases)
    ]
    assert not bad, bad


#: ``python -m workloads.X`` in prose and scripts; ``"workloads.X"`` in a subprocess's argv
COMMAND = re.compile(r"-m\s+(workloads(?:\.[a-z_]\w*)+)|[\"'](workloads\.[a-z_]\w*)[\"']")


def test_every_documented_command_names_a_module():
    sources = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "scripts").glob("*"),
               *(ROOT / ".ci").glob("*"), *WORKLOADS.rglob("*.py"), *WORKLOADS.rglob("*.md"),
               *(ROOT / "tests").rglob("*.py")]
    commands = {
        "".join(groups)
        for path in sources if path.is_file()
        for groups in COMMAND.findall(path.read_text(errors="replace"))
    }
    assert {"workloads.client", "workloads.compare", "workloads.simulate"} <= commands, commands
    missing = sorted(c for c in commands if importlib.util.find_spec(c) is None)
    assert not missing, missing
