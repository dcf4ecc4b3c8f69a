"""Where things are in this project, and what revision it is at."""

from __future__ import annotations

import os
from pathlib import Path

from .git import git

ROOT = Path(__file__).resolve().parents[2]
RELEASES = ROOT / "releases.toml"
PATCHES = ROOT / "patches"
OVERLAY = ROOT / "overlay"
DIST = ROOT / "dist"
# What the tests, the benchmarks and the smoke share (tiny models, real-KV builders, the
# fidelity oracle, the engine's environment, a vLLM test plugin): never shipped.
TEST_SUPPORT = ROOT / "tests" / "support"
BUILD_RECORD_PATH = "vllm/kvwarm/_build_record.json"


def cache_dir(default: Path | None = None) -> Path:
    """KVWARM_CACHE_DIR if set (share downloads and venvs between checkouts), else
    the given default (nox's cache dir), else .nox/.cache in the project."""
    env = os.environ.get("KVWARM_CACHE_DIR")
    return (Path(env) if env else (default or ROOT / ".nox" / ".cache")).resolve()


def revision() -> str:
    """The project's git revision, with -dirty when tracked or new files differ from it."""
    env = os.environ.get("KVWARM_REVISION")
    if env:
        return env

    head = git(ROOT, "rev-parse", "HEAD", check=False, user_config=True)
    if head.returncode != 0:
        return "unknown"
    inputs = ("patches", "overlay", "tooling", "releases.toml")
    dirty = git(ROOT, "status", "--porcelain", "--untracked-files=normal", "--", *inputs, check=False, user_config=True)
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def overlay_files(overlay: Path = OVERLAY) -> dict[str, bytes]:
    """Every overlay file by its path in the wheel (caches and bytecode excluded)."""
    files = {}
    for path in sorted(overlay.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            files[path.relative_to(overlay).as_posix()] = path.read_bytes()
    return files
