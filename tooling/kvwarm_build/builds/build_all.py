"""Every release's wheel, a few builds at a time.

A build is mostly one core's work (reading and hashing the repacked wheel, importing it
once), so on two cores two builds take little longer than one. Each runs as its own
`kvwarm-build build` process, so a failure stays one release's. Their output is interleaved
line by line, each line led by its release.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

from ..errors import BuildError
from ..lanes import run_prefixed
from ..releases import Release, find_release


def chosen(releases: list[Release], only: list[str], checked: set[str]) -> list[Release]:
    """The releases `only` names (versions or short names; every release when empty), in
    table order, with those checked for reproducibility (a check builds its release)."""
    if not only:
        return releases
    named = {find_release(releases, name).short for name in only} | checked
    return [r for r in releases if r.short in named]


def build_all(releases: list[Release], jobs: int, reproducible: set[str], cli_args: list[str]) -> None:
    """Build each release (the cuda flavour), `jobs` at a time; those whose short name is in
    `reproducible` are built twice and compared. cli_args: kvwarm-build's options before
    the command (--releases, --cache, --dist)."""
    if jobs < 1:
        raise BuildError(f"--jobs {jobs}: at least one build must run", "pass --jobs 1 or more")

    def build(release: Release) -> int:
        check = ["--check-reproducible"] if release.short in reproducible else []
        cmd = [sys.executable, "-m", "kvwarm_build", *cli_args, "build", "--release", release.short, *check]
        return run_prefixed(cmd, release.version)

    # The longest (checked twice) first, so the last build to start is a short one.
    ordered = sorted(releases, key=lambda r: r.short not in reproducible)
    with ThreadPoolExecutor(jobs) as pool:
        codes = dict(zip((r.version for r in ordered), pool.map(build, ordered)))
    failed = [version for version, code in codes.items() if code != 0]
    if failed:
        raise BuildError(
            f"the build of {', '.join(failed)} failed",
            "the lines led by that release above say why; `nox -s build-S` builds one alone",
        )
