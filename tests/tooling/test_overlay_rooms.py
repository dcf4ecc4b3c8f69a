"""The overlay's rooms (see vllm/kvwarm/__init__.py) and which way their imports go, read with
`ast` (no vLLM needed): no import cycle, lazy imports inside functions included; the KV room
never reaches the sweep or the adapter; the record room reaches neither."""

from __future__ import annotations

import ast
from pathlib import Path

OVERLAY = Path(__file__).resolve().parents[2] / "overlay" / "vllm" / "kvwarm"
PACKAGE = "vllm.kvwarm"


def module_name(path: Path, root: Path = OVERLAY, package: str = PACKAGE) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join([package, *parts[:-1]] + ([] if parts[-1] == "__init__" else [parts[-1]]))


def imports(root: Path = OVERLAY, package: str = PACKAGE) -> dict[str, set[str]]:
    """{module: the modules of `package` (at `root`) it imports anywhere in its body}."""
    modules = {module_name(p, root, package): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith(package):
                continue
            # `from pkg import module` names a module; `from module import name` does not
            found |= {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules}
            if target in modules:
                found.add(target)
        graph[name] = found - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_overlay_has_no_import_cycle():
    graph = imports()
    assert len(graph) > 20 and graph[f"{PACKAGE}.scheduler"]
    assert cycles(graph) == []


def test_the_cycle_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_imports_go_from_the_adapter_to_the_sweep_to_the_kv_room_to_the_record():
    graph = imports()
    rooms = ("kv", "sweep", "record")
    room = {name: name.split(".")[2] if name.count(".") > 1 and name.split(".")[2] in rooms else name for name in graph}
    allowed = {"kv": {"kv", "record"}, "record": {"record"}, "sweep": {"sweep", "kv", "record", PACKAGE}}
    for name, targets in graph.items():
        if room[name] in allowed:
            wrong = sorted(t for t in targets if room[t] not in allowed[room[name]])
            assert not wrong, f"{name} imports {wrong}"
    # (the sweep reaches the top only for the build record: vllm.kvwarm's own __init__)
