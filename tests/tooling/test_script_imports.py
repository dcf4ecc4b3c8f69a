"""smoke/ and benchmarks/ are folders of scripts that import each other by bare name (the folder
is on sys.path) and packages of helpers (`_served`, `_fidelity`): read with `ast`, no import
cycle between them, lazy imports inside functions included (the overlay's and the tooling's
own checks: test_overlay_rooms, test_tooling_rooms)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_overlay_rooms import cycles

ROOT = Path(__file__).resolve().parents[2]


def local_modules(folder: Path) -> dict[str, Path]:
    """{dotted name: file} of the folder's scripts and of its packages' modules."""
    found = {}
    for path in folder.rglob("*.py"):
        parts = path.relative_to(folder).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            found[".".join(parts)] = path
    return found


def script_imports(folder: Path) -> dict[str, set[str]]:
    """{module: the folder's modules it imports anywhere in its body}."""
    modules = local_modules(folder)
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                targets = [target, *(f"{target}.{a.name}" for a in node.names)]
            else:
                continue
            found |= {t for t in targets if t in modules}
        graph[name] = found - {name}
    return graph


@pytest.mark.parametrize("folder", ["smoke", "benchmarks"])
def test_the_scripts_have_no_import_cycle(folder):
    graph = script_imports(ROOT / folder)
    assert len(graph) > 4 and any(graph.values()), f"{folder}/: the reader found no imports between its modules"
    assert cycles(graph) == []


def test_the_reader_sees_a_cycle_between_scripts(tmp_path):
    (tmp_path / "one.py").write_text("import two\n")
    (tmp_path / "two.py").write_text("def f():\n    from three import x\n")
    (tmp_path / "three.py").write_text("from one import y\n")
    (tmp_path / "_pkg").mkdir()
    (tmp_path / "_pkg" / "__init__.py").write_text("")
    (tmp_path / "_pkg" / "a.py").write_text("from .b import z\n")
    (tmp_path / "_pkg" / "b.py").write_text("from _pkg import a\n")
    graph = script_imports(tmp_path)
    assert graph["_pkg.a"] == {"_pkg.b"} and "_pkg.a" in graph["_pkg.b"]
    assert sorted(map(tuple, cycles(graph))) == [("_pkg.a", "_pkg.b", "_pkg.a"), ("one", "two", "three", "one")]
