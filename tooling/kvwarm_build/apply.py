"""Check and apply a series with `git apply`: exact context, no fuzz, no 3-way, no rejects.

The series is applied in a private scratch folder holding only the files it touches, one
patch at a time with `git apply --check` before each, so a failure names the patch and its
first failing file and nothing outside the scratch folder has been written.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import BuildError
from .series import FLAVOUR_SPECIFIC, Patch, Series

_FAILED_FILE = re.compile(r"error: (?:patch failed: )?(?P<file>[^:\s]+)(?::\d+)?:?")


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(cwd.parent), LC_ALL="C")
    # Outside any repository `git apply` works on plain files; the ceiling stops it from
    # discovering an enclosing repository and resolving paths against that instead.
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=False)


def touched_paths(patch: Patch, scratch: Path) -> list[str]:
    result = _git(["apply", "--numstat", "-z", str(patch.path.resolve())], scratch)
    if result.returncode != 0:
        raise BuildError(
            f"{patch.path} is not a patch git can read: {result.stderr.strip()}",
            "regenerate it with the export session (git format-patch)",
        )
    paths = []
    for record in result.stdout.split("\0"):
        if record.strip():
            paths.append(record.split("\t", 2)[2])
    return paths


def _first_failing_file(stderr: str) -> str:
    for line in stderr.splitlines():
        match = _FAILED_FILE.match(line.strip())
        if match:
            return match["file"]
    return "?"


def apply_series(series: Series, read: Callable[[str], bytes | None]) -> dict[str, bytes | None]:
    """Apply `series` to files given by `read(path)` (None = absent).

    Returns the new content of every touched path (None = deleted by the series).
    """
    with tempfile.TemporaryDirectory(prefix="kvwarm-apply-") as tmp:
        scratch = Path(tmp) / "tree"
        scratch.mkdir()
        touched: set[str] = set()
        for patch in series.patches:
            paths = touched_paths(patch, scratch)
            bad = sorted(set(paths) & set(FLAVOUR_SPECIFIC))
            if bad:
                raise BuildError(
                    f"{patch.path} touches {', '.join(bad)}, which differ between the cuda and cpu wheels",
                    "hook the behaviour elsewhere; the build tooling owns the version file",
                )
            for path in paths:
                if path in touched:
                    continue
                touched.add(path)
                content = read(path)
                if content is not None:
                    target = scratch / path
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(content)
            patch_file = str(patch.path.resolve())
            check = _git(["apply", "--check", patch_file], scratch)
            if check.returncode != 0:
                raise BuildError(
                    f"{patch.name} does not apply: first failing file "
                    f"{_first_failing_file(check.stderr)}\n{check.stderr.strip()}",
                    f"refresh {patch.path} against this release (see docs/maintaining.md); nothing was written",
                )
            applied = _git(["apply", patch_file], scratch)
            if applied.returncode != 0:  # --check passed, so this is unexpected
                raise BuildError(f"{patch.name}: git apply failed: {applied.stderr.strip()}", "report this")
        result = {}
        for path in sorted(touched):
            target = scratch / path
            result[path] = target.read_bytes() if target.is_file() else None
        return result
