"""The whole build on a tiny release wheel: label, tags, record, overlay, reproducibility,
and nothing half-done when an input is bad."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
from conftest import COMPILED, VERSION, entries, make_patches, release_toml, sha256

from kvwarm_build import project
from kvwarm_build.builds.build import build, check_reproducible, current_record
from kvwarm_build.builds.series import read_series
from kvwarm_build.builds.validate import compiled_problems, import_problems, record_problems, validate
from kvwarm_build.errors import BuildError
from kvwarm_build.releases import find_release, load_releases

LABELLED = f"{VERSION}+kvwarm.3"


def run_build(tree, **kwargs):
    release = find_release(load_releases(tree["root"] / "releases.toml"), VERSION)
    kwargs.setdefault("validate", lambda wheel, upstream, record: validate(wheel, upstream, "vllm", record, None))
    return build(
        release,
        "cuda",
        tree["cache"],
        dist=tree["dist"],
        log=lambda *_: None,
        patches_root=tree["patches"],
        overlay_root=tree["overlay"],
        **kwargs,
    )


def test_build_labels_retags_patches_and_records(tree):
    wheel = run_build(tree)
    assert wheel.name == f"vllm-{LABELLED}-cp38-abi3-manylinux_2_28_x86_64.whl"
    files = entries(wheel)
    info = f"vllm-{LABELLED}.dist-info"
    assert f"Version: {LABELLED}\n" in files[f"{info}/METADATA"].decode()
    assert "Tag: cp38-abi3-manylinux_2_28_x86_64\n" in files[f"{info}/WHEEL"].decode()
    assert "linux_x86_64\n" not in files[f"{info}/WHEEL"].decode().replace("manylinux_2_28_x86_64", "")
    version_py = files["vllm/_version.py"].decode()
    assert f"__version__ = version = '{LABELLED}'" in version_py
    assert "(9, 9, 1, 'kvwarm.3')" in version_py
    assert not any(n.startswith(f"vllm-{VERSION}.dist-info/") for n in files)
    # The series: a changed upstream file and a new one; the overlay and the record.
    assert b"return 3  # hooked" in files["vllm/v1/core/block_pool.py"]
    assert files["vllm/v1/core/kvwarm_hooks.py"] == b"HOOKED = True\n"
    assert files["vllm/kvwarm/__init__.py"] == (project.OVERLAY / "vllm/kvwarm/__init__.py").read_bytes()
    record = json.loads(files[project.BUILD_RECORD_PATH])
    assert record["release"] == VERSION and record["flavour"] == "cuda"
    assert record["version"] == LABELLED
    assert record["upstream_sha256"] == sha256(tree["wheel"])
    assert len(record["series_digest"]) == 64 and record["revision"]
    for name, data in COMPILED.items():
        assert files[name] == data
    assert list(tree["dist"].iterdir()) == [wheel]  # no staging leftovers


def test_two_builds_are_byte_identical(tree, monkeypatch):
    # Different wall clocks (and a stray SOURCE_DATE_EPOCH) must not reach the bytes.
    monkeypatch.setattr("time.time", lambda: 1_000_000_000.0)
    first = run_build(tree)
    saved = first.read_bytes()
    first.unlink()
    monkeypatch.setattr("time.time", lambda: 1_600_000_000.0)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1234567890")
    assert run_build(tree).read_bytes() == saved


def test_series_change_changes_digest_and_output(tree):
    first = json.loads(entries(run_build(tree))[project.BUILD_RECORD_PATH])
    folder = tree["patches"] / f"vllm-{VERSION}"
    shutil.rmtree(folder)
    make_patches(folder, [("Other hook", "vllm/v1/core/block_pool.py", "    return 5\n", "    return 50\n")])
    second = json.loads(entries(run_build(tree))[project.BUILD_RECORD_PATH])
    assert first["series_digest"] != second["series_digest"]


def test_failing_patch_leaves_no_wheel_and_keeps_the_old_one(tree):
    good = run_build(tree)
    kept = good.read_bytes()
    folder = tree["patches"] / f"vllm-{VERSION}"
    second = read_series(folder).patches[0].path
    second.write_text(second.read_text().replace("-    return 3\n", "-    return 333\n"))
    with pytest.raises(BuildError) as err:
        run_build(tree)
    message = str(err.value)
    assert second.name in message and "vllm/v1/core/block_pool.py" in message
    assert "fix:" in message
    assert list(tree["dist"].iterdir()) == [good] and good.read_bytes() == kept


def test_failed_validation_leaves_no_wheel(tree):
    def refuse(wheel, upstream, record):
        raise BuildError("validator said no", "nothing")

    with pytest.raises(BuildError, match="validator said no"):
        run_build(tree, validate=refuse)
    assert list(tree["dist"].iterdir()) == []


def test_patch_touching_flavour_specific_file_is_refused(tree):
    folder = tree["patches"] / f"vllm-{VERSION}"
    shutil.rmtree(folder)
    make_patches(folder, [("Bad", "vllm/platforms/__init__.py", "'cuda'", "'cpu'")])
    with pytest.raises(BuildError, match="vllm/platforms/__init__.py"):
        run_build(tree)


def test_overlay_may_not_replace_upstream_files(tree):
    (tree["overlay"] / "vllm" / "version.py").write_text("hijack\n")
    with pytest.raises(BuildError, match="vllm/version.py"):
        run_build(tree)
    assert not tree["dist"].exists() or not any(tree["dist"].iterdir())


def _rewrite(wheel: Path, name: str, data: bytes) -> None:
    """Change one entry's bytes without touching RECORD (what tampering looks like)."""
    with zipfile.ZipFile(wheel) as zf:
        items = [(i, zf.read(i)) for i in zf.infolist()]
    with zipfile.ZipFile(wheel, "w") as zf:
        for info, old in items:
            zf.writestr(info, data if info.filename == name else old)


def test_unchanged_entries_are_copied_as_the_release_wheel_stores_them(tree):
    # One entry stored uncompressed (as wheels may keep small or incompressible files), the
    # others deflated: each unchanged one keeps its stored bytes; a patched one is written anew.
    with zipfile.ZipFile(tree["wheel"]) as zf:
        items = [(i, zf.read(i)) for i in zf.infolist()]
    with zipfile.ZipFile(tree["wheel"], "w") as zf:
        for info, data in items:
            info.compress_type = zipfile.ZIP_STORED if info.filename == "vllm/version.py" else zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    (tree["root"] / "releases.toml").write_text(release_toml(tree["wheel"]))
    wheel = run_build(tree)
    with zipfile.ZipFile(tree["wheel"]) as up, zipfile.ZipFile(wheel) as built:
        stored = lambda info: (info.compress_type, info.compress_size, info.CRC)
        ours = {i.filename: i for i in built.infolist()}
        for name in ("vllm/version.py", "vllm/__init__.py", *COMPILED):
            assert stored(ours[name]) == stored(up.getinfo(name)) and built.read(name) == up.read(name)
            assert ours[name].date_time == max(i.date_time for i in up.infolist())
        assert ours["vllm/version.py"].compress_type == zipfile.ZIP_STORED
        assert ours["vllm/v1/core/block_pool.py"].CRC != up.getinfo("vllm/v1/core/block_pool.py").CRC
    assert record_problems(wheel) == []


def test_validation_catches_tampered_entries_and_changed_compiled_files(tree):
    wheel = run_build(tree, validate=None)
    assert record_problems(wheel) == [] and compiled_problems(wheel, tree["wheel"]) == []
    _rewrite(wheel, "vllm/_C.abi3.so", b"not the upstream binary")
    problems = record_problems(wheel)
    assert any("vllm/_C.abi3.so" in p for p in problems)


def test_compiled_check_compares_against_upstream(tree, tmp_path):
    # A wheel whose RECORD is consistent but whose .so differs from upstream:
    wheel = run_build(tree, validate=None)
    from wheel.wheelfile import WheelFile

    fresh = tmp_path / "fresh" / wheel.name
    fresh.parent.mkdir()
    with zipfile.ZipFile(wheel) as src, WheelFile(fresh, "w") as dst:
        for info in src.infolist():
            if not info.filename.endswith("/RECORD"):
                dst.writestr(info, b"x" if info.filename.endswith(".so") else src.read(info))
    assert record_problems(fresh) == []
    assert compiled_problems(fresh, tree["wheel"]) == [
        f"{fresh.name}: vllm/_C.abi3.so differs from {tree['wheel'].name} (or is missing from one)"
    ]


def test_installed_wheel_reports_label_and_record(tree):
    """Install --no-deps into a throwaway venv and import it (the fixture vLLM is light)."""
    import sysconfig

    wheel = run_build(tree, validate=None)
    record = json.loads(entries(wheel)[project.BUILD_RECORD_PATH])
    deps = Path(sysconfig.get_paths()["purelib"])  # pip comes from here
    # The fixture vLLM has none of the modules the overlay uses: check one it has, and one it lacks.
    assert import_problems(wheel, "vllm", record, deps, modules=["vllm.version"]) == []
    wrong = dict(record, series_digest="0" * 64)
    problems = import_problems(wheel, "vllm", wrong, deps, modules=["vllm.version", "vllm.v1.gone"])
    assert len(problems) == 2 and "build_record()" in problems[1]
    assert problems[0].startswith("import vllm.v1.gone failed (the overlay uses it): ModuleNotFoundError")


def test_reproducibility_check_passes_and_catches_a_difference(tree):
    wheel = run_build(tree, validate=None)
    release = find_release(load_releases(tree["root"] / "releases.toml"), VERSION)
    roots = {"patches_root": tree["patches"], "overlay_root": tree["overlay"]}
    check_reproducible(release, "cuda", tree["cache"], wheel, log=lambda *_: None, **roots)
    (tree["overlay"] / "vllm" / "kvwarm" / "extra.py").write_text("X = 1\n")
    with pytest.raises(BuildError, match="differ: .*vllm/kvwarm/extra.py"):
        check_reproducible(release, "cuda", tree["cache"], wheel, log=lambda *_: None, **roots)


def test_the_current_record_is_read_from_the_given_roots(tree):
    wheel = run_build(tree, validate=None)
    release = find_release(load_releases(tree["root"] / "releases.toml"), VERSION)
    roots = {"patches_root": tree["patches"], "overlay_root": tree["overlay"]}
    record = json.loads(entries(wheel)[project.BUILD_RECORD_PATH])
    assert current_record(release, "cuda", **roots) == record
    (tree["overlay"] / "vllm" / "kvwarm" / "extra.py").write_text("X = 1\n")
    assert current_record(release, "cuda", **roots)["overlay_digest"] != record["overlay_digest"]


def test_layered_venv_is_reused_until_its_inputs_change(tmp_path):
    from kvwarm_build.venvs.deps import ensure_layered_venv, site_packages

    deps, other = tmp_path / "deps", tmp_path / "other"
    deps.mkdir(), other.mkdir()
    messages = []
    python = ensure_layered_venv(tmp_path / "v", deps, [], log=messages.append)
    assert (site_packages(python) / "_kvwarm_deps.pth").read_text().strip() == str(deps)
    (tmp_path / "v" / "mine").write_text("kept while the inputs stay the same")
    ensure_layered_venv(tmp_path / "v", deps, [], log=messages.append)
    assert (tmp_path / "v" / "mine").exists() and len(messages) == 1
    ensure_layered_venv(tmp_path / "v", other, [], log=messages.append)
    assert not (tmp_path / "v" / "mine").exists() and len(messages) == 2
    assert (site_packages(python) / "_kvwarm_deps.pth").read_text().strip() == str(other)
