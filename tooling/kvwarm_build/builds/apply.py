"""Check and apply a series with `git apply`: exact context, no fuzz, no 3-way, no rejects.

The series is applied in a private scratch folder holding only the files it touches, one
patch at a time with `git apply --check` before each, so a failure names the patch and its
first failing file and nothing outside the scratch folder has been written.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..errors import BuildError
from ..git import git
from .series import FLAVOUR_SPECIFIC, Patch, Series

_FAILED_FILE = re.compile(r"error: (?:patch failed: )?(?P<file>[^:\s]+)(?::\d+)?:?")


def git_apply(scratch: Path, *args: str) -> subprocess.CompletedProcess:
    """`git apply ARGS` on the plain files in `scratch` (returncode for the caller to read)."""
    return git(scratch, "apply", *args, check=False, outside_repo=True)


def touched_paths(patch: Patch, scratch: Path) -> list[str]:
    result = git_apply(scratch, "--numstat", "-z", str(patch.path.resolve()))
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
            check = git_apply(scratch, "--check", patch_file)
            if check.returncode != 0:
                raise BuildError(
                    f"{patch.name} does not apply: first failing file "
                    f"{_first_failing_file(check.stderr)}\n{check.stderr.strip()}",
                    f"refresh {patch.path} against this release (see docs/maintaining.md); nothing was written",
                )
            applied = git_apply(scratch, patch_file)
            if applied.returncode != 0:  # --check passed, so this is unexpected
                raise BuildError(f"{patch.name}: git apply failed: {applied.stderr.strip()}", "report this")
        result = {}
        for path in sorted(touched):
            target = scratch / path
            result[path] = target.read_bytes() if target.is_file() else None
        return result
