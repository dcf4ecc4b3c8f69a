"""Warm-cache build time of one release against `pip download` + unzip of the same wheel.

Runs inside a release venv (`nox -s bench-S -- build_time`); KVWARM_RELEASE names the
release. Both sides run once untimed first so caches are warm, then once timed.

`--quick` (or KVWARM_BENCH_QUICK=1), for CI, where a build takes minutes: the build's
up-to-date path (`build --if-stale` beside the wheel the session has just installed: the
inputs digested, the wheel found fresh, nothing repacked) against reading the cached
wheel once, each once; a check that the command and the cache still work, not a build time.
The last line is the JSON result.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from kvwarm_build import project
from kvwarm_build.releases import find_release, load_releases
from kvwarm_build.sessions import quick_mode

TARGET_RATIO = 3.0


def timed(func) -> float:
    started = time.perf_counter()
    func()
    return time.perf_counter() - started


def build(release: str, *extra: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "kvwarm_build", "build", "--release", release, *extra],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def read_cached(wheel: str) -> None:
    digest = hashlib.sha256()
    with open(project.cache_dir() / "downloads" / wheel, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)


def download_and_unzip(version: str, wheel: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--platform",
                "manylinux_2_28_x86_64",
                "--python-version",
                "3.12",
                "--implementation",
                "cp",
                "--abi",
                "abi3",
                f"vllm=={version}",
                "-d",
                tmp,
            ],
            check=True,
        )
        target = Path(tmp) / "unpacked"
        if shutil.which("unzip"):
            subprocess.run(["unzip", "-q", str(Path(tmp) / wheel), "-d", str(target)], check=True)
        else:
            zipfile.ZipFile(Path(tmp) / wheel).extractall(target)


def main() -> None:
    release = find_release(
        load_releases(project.RELEASES), os.environ.get("KVWARM_RELEASE") or load_releases(project.RELEASES)[-1].version
    )
    wheel = release.flavour("cuda").wheel.file
    if quick_mode(sys.argv, os.environ):
        quick(release, wheel)
        return
    print(f"release {release.version}: warming caches (one untimed run of each side)", flush=True)
    build(release.short)
    download_and_unzip(release.version, wheel)
    ours = timed(lambda: build(release.short))
    print(f"build (fetch from cache, apply, repack, validate): {ours:.1f} s", flush=True)
    baseline = timed(lambda: download_and_unzip(release.version, wheel))
    print(f"pip download + unzip of {wheel}: {baseline:.1f} s", flush=True)
    print(
        json.dumps(
            {
                "metric": f"build_time_warm_cache_{release.short}",
                "value": round(ours, 2),
                "unit": "s",
                "baseline": round(baseline, 2),
                "ratio": round(ours / baseline, 2),
                "target": f"ratio <= {TARGET_RATIO:g}",
            }
        )
    )


def quick(release, wheel: str) -> None:
    ours = timed(lambda: build(release.short, "--if-stale"))
    print(f"quick: build --if-stale (the wheel is up to date): {ours:.1f} s", flush=True)
    baseline = timed(lambda: read_cached(wheel))
    print(f"quick: reading the cached {wheel} once (sha256): {baseline:.1f} s", flush=True)
    print(
        json.dumps(
            {
                "metric": f"build_time_up_to_date_{release.short}_quick",
                "value": round(ours, 2),
                "unit": "s",
                "baseline": round(baseline, 2),
                "ratio": round(ours / baseline, 2),
                "target": "none in quick mode (the command and the cache work; the full mode times a build)",
            }
        )
    )


if __name__ == "__main__":
    main()
