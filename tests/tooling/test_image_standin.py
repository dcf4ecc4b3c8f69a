"""The stand-in build's own bookkeeping, with a recording stand-in for buildah: what it
leaves in the image store when a check fails."""

from __future__ import annotations

import json
import stat
import tarfile
from pathlib import Path

import pytest

from kvwarm_build import project
from kvwarm_build.builds.build import output_name
from kvwarm_build.errors import BuildError
from kvwarm_build.images import standin as image_standin
from kvwarm_build.images.builders import Builder
from kvwarm_build.images.dockerfile import DIST_ALIAS
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
    script.write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\n'
        f'case "$1" in inspect) cat {answer} ;; bud) for a; do :; done; ls "$a" >> {calls} ;; esac\n'
        "exit 0\n"
    )
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
        image_standin.build_and_check(builder, NEWEST, wheel, record, "localhost/kvwarm-standin:x", log=lambda *_: None)
    made = f"localhost/kvwarm-standin-built:{NEWEST.version}"
    lines = calls.read_text().splitlines()
    built = next(i for i, line in enumerate(lines) if line.startswith("bud "))
    assert f"rmi -f {made}" in lines[built + 1 :]


def test_the_build_context_is_the_wheel_and_the_alias_script(tmp_path):
    builder, calls = recording_buildah(tmp_path / "bin")
    wheel, record = fake_wheel(tmp_path)
    with pytest.raises(BuildError):  # the stand-in buildah's image has no labels
        image_standin.build_and_check(builder, NEWEST, wheel, record, "localhost/kvwarm-standin:x", log=lambda *_: None)
    lines = calls.read_text().splitlines()
    built = next(i for i, line in enumerate(lines) if line.startswith("bud "))
    assert sorted(lines[built + 1 : built + 3]) == sorted([wheel.name, DIST_ALIAS.name])
    assert lines[built + 3].startswith("inspect ")


# --- the stand-in base's layout, per flavour --------------------------------------------------


def layout_buildah(folder: Path, mount: Path) -> tuple[Builder, Path]:
    """A buildah that logs its calls, knows no image, and mounts every container at `mount`."""
    folder.mkdir()
    calls = folder / "calls"
    script = folder / "buildah"
    script.write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\n'
        f'case "$1" in inspect) exit 1 ;; from) echo ctr ;; mount) echo {mount} ;; esac\nexit 0\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return Builder("buildah", (str(script),)), calls


@pytest.mark.parametrize("flavour", ["cuda", "cpu"])
def test_the_standin_is_laid_out_like_the_flavours_official_image(tree, tmp_path, flavour):
    release = load_releases(tree["root"] / "releases.toml")[0]
    cache = tree["cache"]
    # What debootstrap and pip download would have left in the cache.
    (cache / "images" / "uv").mkdir(parents=True)
    (cache / "images" / "uv" / f"uv-{image_standin.STANDIN_UV.partition('==')[2]}-py3-none-any.whl").write_bytes(b"")
    rootfs = tmp_path / "rootfs"
    (rootfs / "usr" / "bin").mkdir(parents=True)
    with tarfile.open(
        cache / "images" / f"{image_standin.STANDIN_SUITE}-minbase-{'-'.join(image_standin.STANDIN_PACKAGES)}.tar", "w"
    ) as tar:
        tar.add(rootfs, arcname=".")
    deps = tmp_path / "deps" / "lib" / f"python{image_standin.STANDIN_PYTHON}" / "site-packages"
    deps.mkdir(parents=True)
    (deps / "a_dependency.py").write_text("")
    mount = tmp_path / "mount"
    mount.mkdir()
    builder, calls = layout_buildah(tmp_path / "bin", mount)

    name = image_standin.ensure_standin(builder, release, flavour, cache, deps, log=lambda *_: None)

    stock = f"/tmp/kvwarm-wheels/{tree['wheel'].name}"
    lines = calls.read_text().splitlines()
    config = next(line for line in lines if line.startswith("config "))
    assert '--entrypoint ["vllm", "serve"] --workingdir /vllm-workspace' in config
    if flavour == "cuda":
        assert name == f"localhost/kvwarm-standin:{release.version}"
        assert (mount / "usr/local/lib/python3.11/dist-packages/a_dependency.py").exists()
        assert (
            f"run --isolation chroot ctr -- python3 -m pip install -q --break-system-packages "
            f"--no-index --no-deps {stock}"
        ) in lines
        assert "VIRTUAL_ENV" not in config
    else:
        assert name == f"localhost/kvwarm-standin-cpu:{release.version}"
        venv = lines.index("run --isolation chroot ctr -- uv venv --offline --python /usr/bin/python3 /opt/venv")
        install = lines.index(
            "run --isolation chroot ctr -- uv pip install --offline --python /opt/venv/bin/python "
            f"--no-index --no-deps {stock}"
        )
        assert venv < install
        assert (mount / "opt/venv/lib/python3.11/site-packages/a_dependency.py").exists()
        assert f"--env VIRTUAL_ENV=/opt/venv --env PATH={image_standin.CPU_PATH}" in config
        assert image_standin.CPU_PATH.startswith("/opt/venv/bin:")
    assert lines[-1] == f"commit -q --rm ctr {name}"
    assert not (mount / "tmp" / "kvwarm-wheels").exists()


def test_the_standin_command_takes_a_flavour():
    from kvwarm_build.cli import parser

    args = parser().parse_args(["image-standin", "--release", NEWEST.short, "--flavour", "cpu"])
    assert (args.flavour, args.func.__name__) == ("cpu", "cmd_image_standin")
    assert parser().parse_args(["image-standin", "--release", NEWEST.short]).flavour == "cuda"


def test_a_new_standin_base_replaces_the_other_releases_bases(tmp_path):
    """Every release's base kept would fill the disk over a matrix: the store keeps one."""
    folder = tmp_path / "bin"
    folder.mkdir()
    calls, script = folder / "calls", folder / "buildah"
    listed = [
        "localhost/kvwarm-standin:8.8.0",
        "localhost/kvwarm-standin-cpu:8.8.0",
        "localhost/kvwarm-standin-built:8.8.0",
        "localhost/kvwarm-standin:9.9.0",
        "docker.io/other:1",
    ]
    script.write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\n[ "$1" = images ] && printf "%s\\n" {" ".join(listed)}\nexit 0\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    said = []
    image_standin.drop_other_standins(Builder("buildah", (str(script),)), "localhost/kvwarm-standin:9.9.0", said.append)
    removed = [line.split()[1] for line in calls.read_text().splitlines() if line.startswith("rmi")]
    assert removed == ["localhost/kvwarm-standin:8.8.0", "localhost/kvwarm-standin-cpu:8.8.0"]
    assert len(said) == 2 and all("one base is kept" in line for line in said)
