"""Offline bundles: pip plans the wheels a target lacks, big files are cut into parts, and
install.py verifies, joins, installs offline and runs the selfcheck of a fake release."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from wheel.wheelfile import WheelFile

from kvwarm_build import project
from kvwarm_build.builds.build import encode_record
from kvwarm_build.bundles.make import MIB, index_options, make_bundle
from kvwarm_build.bundles.resolve import Target, read_have, resolve
from kvwarm_build.errors import BuildError

FAKE = "9.9.1+kvwarm.3"  # a fake release of the patched build
DIGEST = "d" * 64
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"
OTHER = "3.12" if HERE != "3.12" else "3.11"


def make_wheel(folder: Path, name: str, version: str, requires=(), files=None, tag: str = "py3-none-any") -> Path:
    path = folder / f"{name}-{version}-{tag}.whl"
    with WheelFile(path, "w") as zf:
        for member, data in (files or {f"{name}/__init__.py": f"VERSION = {version!r}\n"}).items():
            zf.writestr(member, data)
        info = f"{name}-{version}.dist-info"
        zf.writestr(
            f"{info}/METADATA",
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            + "".join(f"Requires-Dist: {r}\n" for r in requires),
        )
        zf.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}\n")
    return path


def make_fake_release(folder: Path) -> Path:
    """A patched "vllm" wheel: the real overlay (its selfcheck), a build record, and an
    incompressible 2.5 MiB entry so that it splits into three 1 MiB parts."""
    record = {"version": FAKE, "series_digest": DIGEST, "release": "9.9.1", "flavour": "cuda"}
    files = {
        "vllm/__init__.py": f"__version__ = {FAKE!r}\n",
        "vllm/_blob.bin": random.Random(0).randbytes(5 * MIB // 2),
        project.BUILD_RECORD_PATH: encode_record(record),
        **project.overlay_files(),
    }
    requires = [
        "alpha>=1",
        "gamma",
        "mu",
        f'delta; python_version == "{OTHER}"',
        f'epsilon; python_version == "{HERE}"',
    ]
    return make_wheel(folder, "vllm", FAKE, requires, files, tag="cp38-abi3-manylinux_2_28_x86_64")


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> Path:
    """A folder of wheels pip reads with --find-links (no network)."""
    folder = tmp_path_factory.mktemp("index")
    make_wheel(folder, "alpha", "1.0", ["beta>=2"])
    make_wheel(folder, "beta", "1.0")
    make_wheel(folder, "beta", "2.0")
    make_wheel(folder, "gamma", "1.0", ["zeta"])
    # mu 2.0 needs a kappa newer than the one a host package ("pinner") pins.
    make_wheel(folder, "mu", "1.0", ["kappa>=1"])
    make_wheel(folder, "mu", "2.0", ["kappa>=2"])
    make_wheel(folder, "kappa", "1.0")
    make_wheel(folder, "kappa", "2.0")
    make_wheel(folder, "pinner", "1.0", ["kappa==1.0"])
    for name in ("delta", "epsilon", "zeta"):
        make_wheel(folder, name, "1.0")
    make_fake_release(folder)
    return folder


@pytest.fixture(autouse=True)
def _hermetic_pip(monkeypatch):
    # No pip configuration of this machine (extra indexes, find-links) leaks into the tests.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in [n for n in os.environ if n.startswith("PIP_") and n != "PIP_CONFIG_FILE"]:
        monkeypatch.delenv(name)


def _bundle(index: Path, out: Path, **kwargs) -> dict:
    target = kwargs.pop("target", Target(python_version=HERE))
    return make_bundle(
        index / f"vllm-{FAKE}-cp38-abi3-manylinux_2_28_x86_64.whl",
        out,
        target=target,
        pip_args=["--no-index", "--find-links", str(index)],
        log=lambda *_: None,
        **kwargs,
    )


@pytest.fixture(scope="module")
def bundle(index, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "full"
    _bundle(index, out, split_mib=1)
    return out


def install(bundle: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(bundle / "install.py"), *args], capture_output=True, text=True, check=False
    )


def test_manifest_lists_every_wheel_and_part(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    by_name = {e["name"]: e for e in manifest["files"]}
    # Every dependency this target's markers select, at the version pip picked; none other.
    assert {n: e["version"] for n, e in by_name.items()} == {
        "vllm": FAKE,
        "alpha": "1.0",
        "beta": "2.0",
        "gamma": "1.0",
        "zeta": "1.0",
        "epsilon": "1.0",
        "mu": "2.0",
        "kappa": "2.0",
    }
    assert manifest["root"] == {
        "file": by_name["vllm"]["file"],
        "dist": "vllm",
        "version": FAKE,
        "series_digest": DIGEST,
        "release": "9.9.1",
        "flavour": "cuda",
    }
    parts = by_name["vllm"]["parts"]
    assert len(parts) == 3 and all(p["size"] <= MIB for p in parts)
    assert sum(p["size"] for p in parts) == by_name["vllm"]["size"]
    listed = {p["file"] for e in manifest["files"] for p in e.get("parts") or [e]}
    assert {p.name for p in (bundle / "wheels").iterdir()} == listed  # the whole vllm wheel is gone


def test_parts_join_install_offline_into_a_fresh_venv_and_selfcheck(bundle, tmp_path):
    venv = tmp_path / "venv"
    done = install(bundle, "--venv", str(venv))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"kvwarm selfcheck: vllm {FAKE}, series {DIGEST[:12]}: ok" in done.stdout
    shown = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import alpha, beta, zeta; print(beta.VERSION)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert shown.stdout.strip() == "2.0"


def test_install_into_a_target_folder_twice(bundle, tmp_path):
    site = tmp_path / "site"
    for _ in range(2):
        done = install(bundle, "--target", str(site))
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"selfcheck: vllm {FAKE}, series {DIGEST[:12]}: ok" in done.stdout
        # A stale install left in the folder: the second run must replace it, not keep it.
        (site / "vllm" / "__init__.py").write_text("__version__ = '0'\n")


def _copy_with(bundle: Path, tmp_path: Path, damage) -> tuple[Path, str]:
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    part = next(e for e in manifest["files"] if e["name"] == "vllm")["parts"][1]["file"]
    damage(copy / "wheels" / part)
    return copy, part


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[1000] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, says", [(_flip_a_byte, "is corrupt"), (Path.unlink, "is missing")])
def test_damaged_part_is_refused_by_name_before_anything_is_installed(bundle, tmp_path, damage, says):
    copy, part = _copy_with(bundle, tmp_path, damage)
    done = install(copy, "--venv", str(tmp_path / "venv"))
    assert done.returncode == 1
    assert f"part 2 of 3 of vllm-{FAKE}" in done.stderr and f"{part} {says}" in done.stderr
    assert "copy it into" in done.stderr and "nothing was installed" in done.stderr
    assert not (tmp_path / "venv").exists()


def test_have_leaves_out_what_the_target_has(index, tmp_path):
    have = tmp_path / "host.txt"
    # gamma as the target has it (and so its zeta); beta too old for alpha's beta>=2.
    # kappa 1.0, which the host's pinner pins: mu 2.0 would replace it, so mu 1.0 is carried.
    # torch: not on this index, so its own requirements stay unknown.
    have.write_text("# pip freeze of the host\ngamma==1.0\nbeta==1.0\nkappa==1.0\npinner==1.0\ntorch==2.13.0+cu130\n")
    manifest = _bundle(index, tmp_path / "out", have_file=have)
    assert {e["name"]: e["version"] for e in manifest["files"]} == {
        "vllm": FAKE,
        "alpha": "1.0",
        "beta": "2.0",
        "epsilon": "1.0",
        "mu": "1.0",
    }
    assert manifest["left_out"] == {"gamma": "1.0", "kappa": "1.0"}
    assert manifest["replaced"] == {"beta": "1.0 -> 2.0"}
    assert manifest["split_mib"] is None and not any("parts" in e for e in manifest["files"])


def test_target_markers_decide_not_this_interpreter(index):
    """pip judges markers by the python that runs it; the plan is made for the target's."""
    plan = resolve(
        index / f"vllm-{FAKE}-cp38-abi3-manylinux_2_28_x86_64.whl",
        {},
        Target(python_version=OTHER),
        ["--no-index", "--find-links", str(index)],
        log=lambda *_: None,
    )
    assert "delta" in plan.wheels and "epsilon" not in plan.wheels


@pytest.mark.parametrize("line", ["torch>=2.11", "torch", "-e git+https://example.invalid/x#egg=x", "torch==2.*"])
def test_have_line_that_pins_no_version_is_named(tmp_path, line):
    have = tmp_path / "host.txt"
    have.write_text(f"numpy==2.0.0\n{line}\n")
    with pytest.raises(BuildError) as err:
        read_have(have)
    assert f"{have}:2" in str(err.value) and err.value.fix


def test_split_size_must_be_positive(index, tmp_path):
    with pytest.raises(BuildError, match="--split-mib 0"):
        _bundle(index, tmp_path / "out", split_mib=0)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "index_url, find_links, no_index, expected",
    [
        (None, [], False, []),  # pip's own configuration
        ("http://mirror.example/simple", [], False, ["--index-url", "http://mirror.example/simple"]),
        (None, ["/w1", "/w2"], True, ["--find-links", "/w1", "--find-links", "/w2", "--no-index"]),
    ],
)
def test_bundle_index_options_are_pips(index_url, find_links, no_index, expected):
    assert index_options(index_url, find_links, no_index) == expected


def test_a_bundle_with_no_index_and_no_wheel_folder_is_refused():
    with pytest.raises(BuildError) as err:
        index_options(None, [], True)
    assert "--no-index" in err.value.problem and "--find-links" in err.value.fix
