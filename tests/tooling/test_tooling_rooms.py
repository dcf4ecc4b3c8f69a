"""The build tooling's rooms (see kvwarm_build/__init__.py) and which way their imports go, read
with `ast` like the overlay's: no import cycle; the shared modules import no room; venvs
reaches no other room, builds only venvs, and upstream, images and bundles reach no room
beside them."""

from __future__ import annotations

from pathlib import Path

from test_overlay_rooms import cycles, imports

TOOLING = Path(__file__).resolve().parents[2] / "tooling" / "kvwarm_build"
PACKAGE = "kvwarm_build"
ROOMS = ("builds", "venvs", "upstream", "images", "bundles")
# What each room may import besides itself and the shared modules at the top.
ALLOWED = {
    "venvs": set(),
    "builds": {"venvs"},
    "upstream": {"builds", "venvs"},
    "images": {"builds", "venvs"},
    "bundles": {"builds", "venvs"},
}
# The commands and the session table: they call into every room.
CONSUMERS = {f"{PACKAGE}.{name}" for name in ("__main__", "cli", "sessions")}


def room_of(module: str) -> str:
    """The room a module is in, "shared" for the other top-level modules, "top" for the package
    itself (its __init__ is the map: `from .. import project` names it too)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "top"
    return parts[1] if parts[1] in ROOMS else "shared"


def test_the_tooling_has_no_import_cycle():
    graph = imports(TOOLING, PACKAGE)
    assert len(graph) > 30 and graph[f"{PACKAGE}.builds.build"]
    assert cycles(graph) == []


def test_every_room_is_a_package_named_in_the_map():
    map_text = (TOOLING / "__init__.py").read_text()
    folders = sorted(p.name for p in TOOLING.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(ROOMS)
    for room in ROOMS:
        assert (TOOLING / room / "__init__.py").is_file(), f"{room}/ has no __init__.py (setuptools skips it)"
        assert f"  {room}/ " in map_text, f"{room}/ is missing from the map in kvwarm_build/__init__.py"


def test_imports_go_from_the_commands_to_the_rooms_to_the_shared_modules():
    graph = imports(TOOLING, PACKAGE)
    for name, targets in graph.items():
        if name in CONSUMERS or room_of(name) == "top":
            continue
        room = room_of(name)
        allowed = {"top", "shared", room} | ALLOWED.get(room, set())  # top: the map, no code
        wrong = sorted(t for t in targets if room_of(t) not in allowed or t in CONSUMERS)
        assert not wrong, f"{name} ({room}) imports {wrong}"
