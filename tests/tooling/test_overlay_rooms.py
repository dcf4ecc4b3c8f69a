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


def test_the_trace_takes_only_the_provenance_of_the_sweep():
    """served/ writes the same run record a sweep's artifact holds (sweep.provenance) and
    nothing else of the sweep; the trace grid reads traces through record.trace alone."""
    graph = imports()
    served = {name: targets for name, targets in graph.items() if name.startswith(f"{PACKAGE}.served.")}
    assert served, "no served/ module found"
    for name, targets in served.items():
        wrong = sorted(t for t in targets if t.startswith(f"{PACKAGE}.sweep") and t != f"{PACKAGE}.sweep.provenance")
        assert not wrong, f"{name} imports {wrong}"
    assert f"{PACKAGE}.sweep.provenance" in graph[f"{PACKAGE}.served.recorder"]
    grid = graph[f"{PACKAGE}.sweep.trace_grid"]
    assert f"{PACKAGE}.record.trace.reader" in grid
    assert not [t for t in grid if t.startswith(f"{PACKAGE}.record.validate") and not t.endswith(".match")]


def test_the_record_keeps_its_rooms():
    """record/ in rooms: export/, trace/ and validate/ are packages, and no module of the record
    is grouped by a name prefix instead (export_*, trace_*, validate_*)."""
    record = OVERLAY / "record"
    for room in ("export", "trace", "validate"):
        assert (record / room / "__init__.py").is_file(), f"record/{room}/ is not a package"
    prefixed = sorted(p.name for p in record.glob("*.py") if p.stem.startswith(("export_", "trace_", "validate_")))
    assert not prefixed, f"modules grouped by prefix in record/: {prefixed}"
