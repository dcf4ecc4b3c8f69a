"""No Python file over 450 lines (the project's standard: a module small enough to read
whole): every .py file under overlay/, tooling/, tests/, smoke/ and benchmarks/, and
noxfile.py. A file that grows past it is split by topic, its shared helpers in a module of
their own."""

from __future__ import annotations

from pathlib import Path

from kvwarm_build import project

LIMIT = 450
FOLDERS = ("overlay", "tooling", "tests", "smoke", "benchmarks")
FILES = ("noxfile.py",)


def python_files(root: Path) -> list[Path]:
    """The checked files under `root`: caches and hidden folders (venvs) left out."""
    found = [root / name for name in FILES if (root / name).is_file()]
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            inside = path.relative_to(root).parts[:-1]
            if not any(part.startswith(".") or part == "__pycache__" for part in inside):
                found.append(path)
    return found


def oversized(root: Path, limit: int = LIMIT) -> list[str]:
    """`PATH: N lines` for every checked file longer than `limit` lines."""
    lengths = {path: len(path.read_text().splitlines()) for path in python_files(root)}
    return [f"{path.relative_to(root).as_posix()}: {n} lines" for path, n in lengths.items() if n > limit]


def test_no_python_file_is_over_the_limit():
    long = oversized(project.ROOT)
    assert not long, f"over {LIMIT} lines (split each by topic): {'; '.join(long)}"


def test_the_check_names_each_long_file_and_its_length(tmp_path):
    (tmp_path / "tests" / "vllm").mkdir(parents=True)
    (tmp_path / "tests" / "vllm" / "test_long.py").write_text("x = 1\n" * (LIMIT + 1))
    (tmp_path / "tests" / "vllm" / "test_short.py").write_text("x = 1\n" * LIMIT)
    (tmp_path / "noxfile.py").write_text("x = 1\n" * (LIMIT + 2))
    (tmp_path / "tests" / ".venv").mkdir()
    (tmp_path / "tests" / ".venv" / "site.py").write_text("x = 1\n" * (LIMIT + 3))  # not ours
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "long.py").write_text("x = 1\n" * (LIMIT + 4))  # not a checked folder
    assert oversized(tmp_path) == [f"noxfile.py: {LIMIT + 2} lines", f"tests/vllm/test_long.py: {LIMIT + 1} lines"]
