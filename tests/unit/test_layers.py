"""The package layout shows the architecture: imports point one way,
node -> session -> substrate (and ``scheduler`` stays pure)."""

import ast
import pathlib

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: package -> Flying packages it must never import
FORBIDDEN = {
    "flying/substrate": ("flying.session", "flying.node", "sglang_patches"),
    "flying/session": ("flying.node", "sglang_patches"),
    "flying/node": ("sglang_patches",),
    "scheduler": ("flying", "sglang_patches", "torch", "zmq", "socket"),
}


def _imports(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package):
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / package).glob("*.py"))
        for name in _imports(path)
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package])
    ]
    assert not bad, bad


def test_flying_top_level_is_only_entry_points():
    top = sorted(p.name for p in (ROOT / "flying").glob("*.py"))
    assert top == ["__init__.py", "launch.py", "version.py"], top
