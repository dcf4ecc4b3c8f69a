"""Maintainer round trip: a release's pristine tree as a git repo with the series applied as
commits (edit there), and a deterministic export of those commits back into patches/.

Export flags follow git-format-patch conventions for committed series: no stat, no
signature, zeroed commit ids, full index lines, subjects kept as written. Git is run with
no user or system config so the output does not depend on who runs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from wheel.wheelfile import WheelFile

from .apply import apply_series
from .errors import BuildError
from .series import Series, header_problems, read_series

UPSTREAM_TAG = "upstream"
EXPORT_FLAGS = [
    "--keep-subject",
    "--no-stat",
    "--no-signature",
    "--zero-commit",
    "--full-index",
    "--no-renames",
    "--no-binary",
    "--minimal",
]
_IDENTITY = {
    "GIT_AUTHOR_NAME": "kvwarm",
    "GIT_AUTHOR_EMAIL": "kvwarm@localhost",
    "GIT_COMMITTER_NAME": "kvwarm",
    "GIT_COMMITTER_EMAIL": "kvwarm@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}


def git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, LC_ALL="C", **_IDENTITY)
    result = subprocess.run(["git", "-C", str(repo), *args], env=env, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise BuildError(f"git {' '.join(args)} in {repo} failed: {result.stderr.strip()}", "see the git message")
    return result


def _is_text(data: bytes) -> bool:
    return b"\0" not in data[:8192]


def materialise(upstream: Path, series: Series, into: Path, force: bool = False, log=print) -> Path:
    """Unpack the release's text files into a fresh git repo at `into`, commit them and
    tag the commit `upstream`, then apply the series as one commit per patch."""
    if into.exists():
        if (into / ".git").exists() and git(into, "status", "--porcelain").stdout.strip() and not force:
            raise BuildError(
                f"{into} has uncommitted changes",
                "commit them and run the export session, or pass --force to discard them",
            )
        if not force:
            raise BuildError(
                f"{into} already exists",
                "run the export session to keep your commits, or pass --force to recreate it",
            )
        shutil.rmtree(into)
    with WheelFile(upstream) as zf:
        names = set(zf.namelist())
        # Check the whole series before anything is written.
        apply_series(series, lambda p: zf.read(p) if p in names else None)
        staging = Path(tempfile.mkdtemp(prefix=f".{into.name}-", dir=into.parent))
        try:
            for info in zf.infolist():
                if info.is_dir() or ".dist-info/" in info.filename or info.filename.endswith(".so"):
                    continue
                data = zf.read(info)
                if _is_text(data):
                    target = staging / info.filename
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(data)
            git(staging, "init", "-q", "-b", "main")
            git(staging, "add", "-A")
            git(staging, "commit", "-q", "-m", f"pristine {upstream.name}")
            git(staging, "tag", UPSTREAM_TAG)
            for patch in series.patches:
                git(staging, "am", "-q", "--keep", "--no-3way", str(patch.path.resolve()))
            os.replace(staging, into)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    log(
        f"{into}: pristine tree tagged {UPSTREAM_TAG!r} + {len(series.patches)} commit(s); "
        "edit, commit, then run the export session"
    )
    return into


def export_patches(repo: Path) -> dict[str, bytes]:
    """format-patch upstream..HEAD of `repo` into {file name: bytes} (writes nothing)."""
    if not (repo / ".git").exists():
        raise BuildError(f"{repo} is not a materialised tree", "run the materialise session first")
    if git(repo, "status", "--porcelain").stdout.strip():
        raise BuildError(f"{repo} has uncommitted changes", "commit (or stash) them, then export")
    with tempfile.TemporaryDirectory(prefix="kvwarm-export-") as tmp:
        git(repo, "format-patch", *EXPORT_FLAGS, "-o", tmp, f"{UPSTREAM_TAG}..HEAD")
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).glob("*.patch"))}


def write_series(dest: Path, patches: dict[str, bytes]) -> None:
    """Make dest's patches and series exactly `patches` (the export's order).

    New files are written before series names them and old ones go last, so an
    interrupted export leaves a folder that lint reports, never a silent mix.
    """
    dest.mkdir(parents=True, exist_ok=True)
    for name, data in patches.items():
        (dest / name).write_bytes(data)
    (dest / "series").write_text("".join(f"{name}\n" for name in patches))
    for old in dest.glob("*.patch"):
        if old.name not in patches:
            old.unlink()


def stale_patches(upstream: Path, series: Series) -> list[str]:
    """Patches whose bytes differ from a fresh materialise + export of the same series."""
    with tempfile.TemporaryDirectory(prefix="kvwarm-roundtrip-") as tmp:
        repo = materialise(upstream, series, Path(tmp) / "tree", log=lambda *_: None)
        fresh = export_patches(repo)
    committed = {p.name: p.data() for p in series.patches}
    problems = []
    for name in sorted(set(fresh) | set(committed)):
        if name not in committed:
            problems.append(f"a fresh export names {name}, which the series lacks")
        elif name not in fresh:
            problems.append(f"{name} is not produced by a fresh export")
        elif fresh[name] != committed[name]:
            problems.append(f"{name} differs from a fresh export (stale or hand-edited)")
    return [f"{series.folder}: {p}" for p in problems]


def lint(series_folder: Path, upstream: Path | None) -> list[str]:
    """All lint problems of one release's series; upstream=None skips the staleness check."""
    try:
        series = read_series(series_folder)
    except BuildError as err:
        return [err.problem]
    problems = [p for patch in series.patches for p in header_problems(patch)]
    if upstream is not None and not problems:
        try:
            problems += stale_patches(upstream, series)
        except BuildError as err:
            problems.append(err.problem)
    return problems
