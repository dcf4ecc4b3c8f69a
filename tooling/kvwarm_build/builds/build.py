"""The build: fetch, check and apply the series, add the overlay, repack, validate."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import zipfile
from pathlib import Path

from wheel.wheelfile import WheelFile

from .. import project
from ..digests import digest_named
from ..errors import BuildError
from ..fetch import fetch
from ..releases import Release
from ..venvs.deps import ensure_deps_venv
from .apply import apply_series
from .repack import WheelName, repack
from .series import read_series, series_folder
from .validate import validate as validate_wheel


def build_record(release: Release, flavour: str, overlay: dict[str, bytes], series_digest: str) -> dict:
    wheel = release.flavour(flavour).wheel
    return {
        "schema": 1,
        "release": release.version,
        "flavour": flavour,
        "version": release.patched_version,
        "upstream_wheel": wheel.file,
        "upstream_sha256": wheel.sha256,
        "series_digest": series_digest,
        "overlay_digest": digest_named(sorted(overlay.items())),
        "revision": project.revision(),
    }


def encode_record(record: dict) -> bytes:
    return (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()


def output_name(release: Release, flavour: str) -> str:
    source = WheelName.parse(release.flavour(flavour).wheel.file)
    return WheelName(source.dist, release.patched_version, source.tag).filename


def read_built_record(wheel: Path) -> dict | None:
    try:
        with WheelFile(wheel) as zf:
            return json.loads(zf.read(project.BUILD_RECORD_PATH))
    except Exception:  # noqa: BLE001 - a missing, partial or foreign wheel is simply not up to date
        return None


def build(
    release: Release,
    flavour: str,
    cache: Path,
    dist: Path = project.DIST,
    validate=None,
    log=print,
    patches_root: Path = project.PATCHES,
    overlay_root: Path = project.OVERLAY,
) -> Path:
    """Build into `dist` and return the wheel path.

    The wheel is written and validated in a staging folder and moved into `dist` only when
    everything passed, so a failed build leaves no wheel behind (an older one is kept).
    `validate(wheel, upstream, record)` raises BuildError on a problem.
    """
    started = time.monotonic()
    series = read_series(series_folder(patches_root, release.version))
    overlay = project.overlay_files(overlay_root)
    if not overlay:
        raise BuildError(f"{overlay_root} is empty", "the overlay must provide vllm/kvwarm")
    record = build_record(release, flavour, overlay, series.digest())
    upstream = fetch(release.flavour(flavour).wheel, cache / "downloads", log=log)
    log(f"applying {len(series.patches)} patch(es) from {series.folder}")
    with WheelFile(upstream) as zf:
        names = set(zf.namelist())
        changed = apply_series(series, lambda p: zf.read(p) if p in names else None)
    replacements = {p: d for p, d in changed.items() if p in names}
    additions = {p: d for p, d in changed.items() if p not in names and d is not None}
    clash = sorted(set(additions) & set(overlay))
    if clash:
        raise BuildError(f"both a patch and the overlay create {clash}", "keep the file in the overlay")
    additions.update(overlay)
    additions[project.BUILD_RECORD_PATH] = encode_record(record)

    dist.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=dist))
    try:
        log(f"repacking {upstream.name} as {output_name(release, flavour)}")
        built = repack(upstream, staging, release.label, replacements, additions, log=log)
        if validate is not None:
            log("validating the built wheel")
            validate(built, upstream, record)
        final = dist / built.name
        os.replace(built, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"built {final} in {time.monotonic() - started:.1f} s")
    return final


def current_record(
    release: Release, flavour: str, patches_root: Path = project.PATCHES, overlay_root: Path = project.OVERLAY
) -> dict:
    """The build record a build from these roots would write now."""
    series = read_series(series_folder(patches_root, release.version))
    return build_record(release, flavour, project.overlay_files(overlay_root), series.digest())


def ensure_built(
    release: Release,
    flavour: str,
    cache: Path,
    dist: Path = project.DIST,
    if_stale: bool = False,
    check: bool = True,
    log=print,
    patches_root: Path = project.PATCHES,
    overlay_root: Path = project.OVERLAY,
) -> Path:
    """Build and validate (unless check=False); with if_stale, reuse a wheel in `dist` that
    was built from exactly the current inputs (same build record)."""
    existing = dist / output_name(release, flavour)
    roots = {"patches_root": patches_root, "overlay_root": overlay_root}
    if if_stale and existing.exists() and read_built_record(existing) == current_record(release, flavour, **roots):
        log(f"{existing} is up to date")
        return existing
    checker = None
    if check:
        deps_site = ensure_deps_venv(release, cache, log=log)
        dist_name = release.flavour(flavour).dist
        checker = lambda wheel, upstream, record: validate_wheel(wheel, upstream, dist_name, record, deps_site)
    return build(release, flavour, cache, dist=dist, validate=checker, log=log, **roots)


def check_reproducible(
    release: Release,
    flavour: str,
    cache: Path,
    wheel: Path,
    log=print,
    patches_root: Path = project.PATCHES,
    overlay_root: Path = project.OVERLAY,
) -> None:
    """Build again from the same inputs and require the very same bytes."""
    log(f"rebuilding to check that {wheel.name} is reproducible")
    with tempfile.TemporaryDirectory(prefix="kvwarm-repro-", dir=cache) as tmp:
        again = build(
            release,
            flavour,
            cache,
            dist=Path(tmp),
            log=lambda *_: None,
            patches_root=patches_root,
            overlay_root=overlay_root,
        )
        if again.read_bytes() == wheel.read_bytes():
            log("second build is byte-identical")
            return
        with zipfile.ZipFile(wheel) as first, zipfile.ZipFile(again) as second:
            a = {i.filename: (i.CRC, i.date_time, i.external_attr) for i in first.infolist()}
            b = {i.filename: (i.CRC, i.date_time, i.external_attr) for i in second.infolist()}
    differing = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n)) or ["(entry order or zip metadata)"]
    raise BuildError(
        f"two builds of {wheel.name} from the same inputs differ: {', '.join(differing[:10])}",
        "find what varies between runs (time, file modes, ordering) in kvwarm_build.builds.repack",
    )
