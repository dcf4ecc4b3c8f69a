"""docs/hooks.md lists every vLLM internal the overlay touches.

The overlay (`overlay/vllm/kvwarm/**/*.py`) is parsed with `ast`, without vLLM. Collected:
every name imported from `vllm` (outside `vllm.kvwarm`), every attribute read or written
(`x.name`), and every name probed as a string (`getattr`/`hasattr`/`setattr` with a literal
or a module-level string constant, the dotted path of a capability row). Not vLLM's, so
subtracted: the names the overlay defines itself (functions, classes, their attributes and
dataclass fields, module-level names; for a probed name only the attributes it assigns on
`self`), attributes of the other modules it imports (stdlib, transformers), and a
short list of methods of builtin and stdlib objects. Whatever is left must appear inside
a backtick span of hooks.md.

A plain attribute access of vLLM's whose name the overlay also defines for its own objects
(`block_size` is both a manager's and a GroupLayout's) is subtracted, so this check cannot
see it: hooks.md lists those by hand.
"""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "overlay" / "vllm" / "kvwarm"
HOOKS = ROOT / "docs" / "hooks.md"

# Methods of builtin types (str, list, dict, set) and of the few stdlib objects the overlay
# keeps in variables (paths, argparse, dataclass fields, exceptions), which ast cannot tell
# from a vLLM object's: an explicit, short list.
BUILTIN_METHODS = frozenset(
    {n for t in (str, bytes, list, dict, set, tuple, int, float) for n in dir(t) if not n.startswith("_")}
) | {
    "name",  # dataclasses.Field.name
    "parent",
    "exists",
    "read_text",
    "read_bytes",
    "write_bytes",
    "write_text",
    "mkdir",
    "with_name",
    "joinpath",
    "resolve",  # pathlib.Path, importlib.resources
    "add_argument",
    "add_mutually_exclusive_group",
    "add_parser",
    "add_subparsers",
    "parse_args",
    "parse_known_args",  # argparse
    "command",
    "json",
    "dist",
    "expect_version",
    "expect_series_digest",
    "points",
    "out",
    "grid_from",
    "grid_caps",  # parsed args
    "writerow",
    "getvalue",
    "shuffle",
    "hexdigest",
    "digest",
    "search",  # csv, io, random, hashlib, re
    "unlink",
    "strftime",
    "__dict__",  # pathlib, time/datetime, any object
    "debug",
    "info",
    "warning",
    "error",
    "exception",  # a logging.Logger (vLLM's init_logger returns one)
    "expanduser",
    "iterdir",  # pathlib.Path
    "is_alive",
    "wait",
    "popleft",  # threading.Thread, threading.Event, collections.deque
    "__name__",
    "__file__",  # a module
    "__index__",
    "__float__",  # the number protocol (served.step_parts.plain)
    "communicate",
    "kill",
    "pid",
    "returncode",  # subprocess.Popen (the trace's writer process)
    "stat",
    "st_size",
    "fileno",  # pathlib.Path, os.stat_result, a file
}


# The record room works on files and plain data only (artifacts, the report; matplotlib's
# and pathlib's names are not vLLM's): left out of the scan, and checked to import nothing
# of vLLM, nor of the overlay's other rooms, so the exemption cannot hide a real access.
PLAIN_DATA_ROOM = "record"


def _modules() -> dict[str, ast.Module]:
    """Every overlay module outside the record room, by its path in the overlay."""
    return {
        path.relative_to(OVERLAY).as_posix(): ast.parse(path.read_text(), str(path))
        for path in sorted(OVERLAY.rglob("*.py"))
        if path.relative_to(OVERLAY).parts[0] != PLAIN_DATA_ROOM
    }


def _record_room() -> dict[str, ast.Module]:
    """The record room's modules: not scanned, but what they define is the overlay's own."""
    return {
        path.relative_to(OVERLAY).as_posix(): ast.parse(path.read_text(), str(path))
        for path in sorted((OVERLAY / PLAIN_DATA_ROOM).rglob("*.py"))
    }


def test_the_record_room_imports_nothing_of_vllm_nor_of_the_other_rooms():
    paths = sorted((OVERLAY / PLAIN_DATA_ROOM).rglob("*.py"))
    assert len(paths) > 3
    for path in paths:
        tree = ast.parse(path.read_text())
        imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m == "vllm" or m.startswith("vllm.")], path
        # a relative import climbs at most to the record room itself (record/, or record/ROOM/ up two)
        depth = len(path.relative_to(OVERLAY / PLAIN_DATA_ROOM).parts)
        outside = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > depth]
        assert not outside, f"{path} imports overlay modules outside the record room: {outside}"


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "literal" (used as attribute names in getattr and hasattr)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = [t for t in node.targets if isinstance(t, ast.Name)]
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            for target in node.targets:
                if isinstance(target, ast.Tuple):
                    targets = target.elts
            for target, value in zip(targets, values):
                if isinstance(target, ast.Name) and isinstance(value, ast.Constant) and isinstance(value.value, str):
                    found[target.id] = value.value
    return found


def _self_assigned(trees: dict[str, ast.Module]) -> set[str]:
    """Attributes the overlay assigns on `self` (its own instance state)."""
    return {
        leaf.attr
        for tree in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for leaf in ast.walk(target)
        if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self"
    }


def _own_names(trees: dict[str, ast.Module]) -> set[str]:
    """Names the overlay defines: modules, functions, classes, class attributes and
    dataclass fields, `self.x` it assigns, module-level names."""
    own = {part.removesuffix(".py") for name in trees for part in name.split("/")} | {"kvwarm"}
    own |= _self_assigned(trees)
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        own.add(item.target.id)
                    if isinstance(item, ast.Assign):
                        own |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        own |= {
            t.id
            for node in tree.body
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            for t in ast.walk(t)
            if isinstance(t, ast.Name)
        }
    return own


def _foreign_aliases(tree: ast.Module) -> set[str]:
    """Local names bound to modules other than vLLM's, or to names imported from them
    (import json; from importlib import resources; from PIL import Image)."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {
                alias.asname or alias.name.split(".")[0] for alias in node.names if alias.name.split(".")[0] != "vllm"
            }
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] != "vllm":
            aliases |= {alias.asname or alias.name for alias in node.names}
    return aliases


def touched(trees: dict[str, ast.Module]) -> dict[str, list[tuple[str, bool]]]:
    """{name: [("file:line", probed), ...]} of every vLLM name the overlay reaches; probed:
    named as a string (getattr/hasattr/setattr, a capability row, an import from vllm),
    so certainly about a foreign object."""
    found: dict[str, list[tuple[str, bool]]] = {}

    def add(name: str, where: str, probed: bool = True) -> None:
        found.setdefault(name, []).append((where, probed))

    for filename, tree in trees.items():
        constants, foreign = _string_constants(tree), _foreign_aliases(tree)
        for node in ast.walk(tree):
            where = f"{filename}:{getattr(node, 'lineno', 0)}"
            if (
                isinstance(node, ast.ImportFrom)
                and (node.module or "").split(".")[0] == "vllm"
                and not (node.module or "").startswith("vllm.kvwarm")
                and node.level == 0
            ):
                for alias in node.names:
                    add(alias.name, where)
            elif isinstance(node, ast.Attribute):
                if isinstance(node.value, ast.Name) and node.value.id in foreign:
                    continue
                add(node.attr, where, probed=False)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr")
                and len(node.args) >= 2
            ):
                arg = node.args[1]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    add(arg.value, where)
                elif isinstance(arg, ast.Name) and arg.id in constants:
                    add(constants[arg.id], where)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Capability":
                for arg in node.args[2:3]:
                    if isinstance(arg, ast.Constant):
                        for part in arg.value.split("."):
                            add(part, where)
                    elif isinstance(arg, ast.JoinedStr):  # f"Class.{CONSTANT}"
                        for piece in arg.values:
                            if isinstance(piece, ast.Constant):
                                for part in piece.value.split("."):
                                    if part:
                                        add(part, where)
                            elif isinstance(piece, ast.FormattedValue) and isinstance(piece.value, ast.Name):
                                add(constants.get(piece.value.id, piece.value.id), where)
    return found


def listed_in_hooks(text: str) -> set[str]:
    """Every identifier inside a backtick span of hooks.md."""
    return {word for span in re.findall(r"`([^`]+)`", text) for word in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", span)}


def unlisted(trees: dict[str, ast.Module], hooks_text: str) -> dict[str, list[str]]:
    """The touched names hooks.md does not list. A plain attribute is skipped when the
    overlay defines that name itself; a probed one only when it is the overlay's own
    instance state (e.g. `getattr(scheduler, "kvwarm_run", None)`)."""
    common = BUILTIN_METHODS | set(dir(builtins)) | listed_in_hooks(hooks_text)
    own, instance_state = _own_names({**trees, **_record_room()}) | common, _self_assigned(trees) | common
    missing = {}
    for name, uses in touched(trees).items():
        where = [w for w, probed in uses if name not in (instance_state if probed else own)]
        if where:
            missing[name] = where
    return missing


def test_every_vllm_internal_the_overlay_touches_is_in_hooks_md():
    missing = unlisted(_modules(), HOOKS.read_text())
    assert not missing, "docs/hooks.md does not list these vLLM names the overlay touches:\n" + "\n".join(
        f"  {name}  ({', '.join(where[:3])})" for name, where in sorted(missing.items())
    )


def test_the_check_sees_an_attribute_hooks_md_does_not_list():
    trees = _modules()
    text = HOOKS.read_text()
    assert "borrowed_kv" in touched(trees) and "borrowed_kv" not in unlisted(trees, text)
    assert "borrowed_kv" in unlisted(trees, text.replace("borrowed_kv", "b_kv"))
    hidden = ast.parse("def f(manager):\n    return manager.renamed_by_vllm, getattr(manager, 'probed')\n")
    assert {"renamed_by_vllm", "probed"} <= set(unlisted({**trees, "extra.py": hidden}, text))
