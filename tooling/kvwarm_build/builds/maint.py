"""Maintainer round trip: a release's pristine tree as a git repo with the series applied as
commits (edit there), and a deterministic export of those commits back into patches/.

The export is a function of the commits alone: the same commits give the same bytes on
any machine (EXPORT_FLAGS says why each flag is set; git runs without user or system
config, whose format.* and diff.* settings would change the output), and each file is
named from its subject (series.patch_file_name), so a patch has one name on every release
and the series file alone holds the order.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from wheel.wheelfile import WheelFile

from ..errors import BuildError
from ..git import git
from .apply import apply_series
from .series import Patch, Series, header_problems, parse_headers, patch_file_name, read_series, series_folder

UPSTREAM_TAG = "upstream"
EXPORT_FLAGS = [
    # The subject as written, without "[PATCH n/m]": a file's bytes must not depend on its
    # place in the series or on how many patches there are.
    "--keep-subject",
    # No diffstat: it repeats the hunks and would change with every edit of a patch.
    "--no-stat",
    # No "-- " trailer with the git version: it would differ with whoever exports.
    "--no-signature",
    # 0000... on the From line instead of the commit id, which every materialise, rebase
    # and amend changes.
    "--zero-commit",
    # Whole blob ids on index lines: an abbreviated id's length grows with the number of
    # objects in the repository.
    "--full-index",
    # A moved file as a deletion and an addition: rename detection is a similarity
    # heuristic, and the patch should say what each path gets.
    "--no-renames",
    # The materialised tree holds text only; a binary change is written as a notice that
    # `git apply` refuses, never as a blob in the series.
    "--no-binary",
    # The smallest diff git finds rather than the quick one: hunks as small as they can be.
    "--minimal",
]


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
    """format-patch upstream..HEAD of `repo` into {file name: bytes} in commit order, each
    named from its subject (series.patch_file_name); writes nothing."""
    if not (repo / ".git").exists():
        raise BuildError(f"{repo} is not a materialised tree", "run the materialise session first")
    if git(repo, "status", "--porcelain").stdout.strip():
        raise BuildError(f"{repo} has uncommitted changes", "commit (or stash) them, then export")
    patches: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="kvwarm-export-") as tmp:
        git(repo, "format-patch", *EXPORT_FLAGS, "-o", tmp, f"{UPSTREAM_TAG}..HEAD")
        # format-patch's own NNNN-... names only give the commit order here.
        for path in sorted(Path(tmp).glob("*.patch")):
            subject = parse_headers(Patch(path)).subject
            try:
                name = patch_file_name(subject)
            except BuildError as err:
                raise BuildError(f"{repo}: {err.problem}", f"reword that commit: {err.fix}") from None
            if name in patches:
                raise BuildError(
                    f"{repo}: two commits give the patch file name {name} (subject {subject!r})",
                    "reword one of them (git rebase -i upstream) so the subjects differ in a letter or digit",
                )
            patches[name] = path.read_bytes()
    return patches


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
    """All lint problems of one release's series (headers, file names, and with `upstream`
    staleness against a fresh export)."""
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


def names_across_releases(folders: list[Path]) -> list[str]:
    """One problem per subject whose patch file has different names in these series (a
    patch carried between releases keeps its name, so the docs can name it once)."""
    names: dict[str, dict[str, list[str]]] = {}
    for folder in folders:
        try:
            series = read_series(folder)
        except BuildError:
            continue  # lint reports it for that folder
        for patch in series.patches:
            subject = parse_headers(patch).subject
            if subject:
                names.setdefault(subject, {}).setdefault(patch.name, []).append(folder.name)
    return [
        f"the patch {subject!r} has different file names: "
        + "; ".join(f"{name} in {', '.join(where)}" for name, where in sorted(by_name.items()))
        for subject, by_name in names.items()
        if len(by_name) > 1
    ]


def lint_releases(releases, patches_root: Path, upstream_of=None, log=print) -> list[str]:
    """Every lint problem of the project's series: a series folder without a release row,
    each release's own problems (lint; `upstream_of(release)` gives the wheel for the
    staleness check, None skips it), and patch names that differ between releases."""
    versions = {r.version for r in releases}
    folders = sorted(patches_root.glob("vllm-*"))
    problems = [f"{f}: no release {f.name[5:]} in releases.toml" for f in folders if f.name[5:] not in versions]
    for release in releases:
        upstream = upstream_of(release) if upstream_of is not None else None
        found = lint(series_folder(patches_root, release.version), upstream)
        log(f"vllm-{release.version}: {len(found)} problem(s)")
        problems += found
    return problems + names_across_releases([series_folder(patches_root, r.version) for r in releases])
