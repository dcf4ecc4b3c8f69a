"""The stand-in build's own bookkeeping, with a recording stand-in for buildah: what it
leaves in the image store when a check fails."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from kvwarm_build import image_standin, project
from kvwarm_build.build import output_name
from kvwarm_build.errors import BuildError
from kvwarm_build.image_builders import Builder
from kvwarm_build.images import DIST_ALIAS
from kvwarm_build.releases import load_releases

NEWEST = load_releases(project.RELEASES)[-1]
# What `buildah inspect` says of every image: `vllm serve`, a digest, no labels at all.
INSPECT = [{"OCIv1": {"config": {"Entrypoint": ["vllm", "serve"]}}, "FromImageDigest": "sha256:" + "0" * 64}]


def recording_buildah(folder: Path) -> tuple[Builder, Path]:
    """A buildah that logs each call's arguments, answers `inspect` and succeeds."""
    folder.mkdir()
    calls, answer = folder / "calls", folder / "inspect.json"
    answer.write_text(json.dumps(INSPECT))
    script = folder / "buildah"
    # For `bud`, the build context (the last argument) is listed too, while it exists.
    script.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n'
                      f'case "$1" in inspect) cat {answer} ;; bud) for a; do :; done; ls "$a" >> {calls} ;; esac\n'
                      'exit 0\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return Builder("buildah", (str(script),), ("--isolation", "chroot")), calls


def fake_wheel(tmp_path: Path) -> tuple[Path, dict]:
    wheel = tmp_path / output_name(NEWEST, "cuda")
    wheel.write_bytes(b"not read by the stand-in buildah")
    return wheel, {"version": NEWEST.patched_version, "series_digest": "ab" * 32}


def test_an_image_that_fails_the_build_check_is_removed(tmp_path):
    builder, calls = recording_buildah(tmp_path / "bin")
    wheel, record = fake_wheel(tmp_path)
    with pytest.raises(BuildError, match="label io.kvwarm.series-digest is None"):
        image_standin.build_and_check(builder, NEWEST, wheel, record, "localhost/kvwarm-standin:x",
                                      log=lambda *_: None)
    made = f"localhost/kvwarm-standin-built:{NEWEST.version}"
    lines = calls.read_text().splitlines()
    built = next(i for i, line in enumerate(lines) if line.startswith("bud "))
    assert f"rmi -f {made}" in lines[built + 1:]


def test_the_build_context_is_the_wheel_and_the_alias_script(tmp_path):
    builder, calls = recording_buildah(tmp_path / "bin")
    wheel, record = fake_wheel(tmp_path)
    with pytest.raises(BuildError):  # the stand-in buildah's image has no labels
        image_standin.build_and_check(builder, NEWEST, wheel, record, "localhost/kvwarm-standin:x",
                                      log=lambda *_: None)
    lines = calls.read_text().splitlines()
    built = next(i for i, line in enumerate(lines) if line.startswith("bud "))
    assert sorted(lines[built + 1:built + 3]) == sorted([wheel.name, DIST_ALIAS.name])
    assert lines[built + 3].startswith("inspect ")
