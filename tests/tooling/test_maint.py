"""Maintainer round trip on a tiny release: materialise, edit, export, lint staleness."""

from __future__ import annotations

import shutil

import pytest
from conftest import BLOCK_POOL, GOOD_EDITS, VERSION, git, make_patches

from kvwarm_build.errors import BuildError
from kvwarm_build.maint import export_patches, lint, materialise, write_series
from kvwarm_build.series import read_series


def test_round_trip_is_byte_identical(tree, tmp_path):
    folder = tree["patches"] / f"vllm-{VERSION}"
    series = read_series(folder)
    repo = materialise(tree["wheel"], series, tmp_path / "work", log=lambda *_: None)
    assert "# hooked" in (repo / "vllm/v1/core/block_pool.py").read_text()
    assert not (repo / "vllm/_C.abi3.so").exists()  # binaries stay out of the tree
    log = git(repo, "log", "--format=%s", "upstream..HEAD").split("\n")[:2]
    assert log == ["Add a new module", "Add a hook to helper_3"]
    exported = export_patches(repo)
    assert exported == {p.name: p.data() for p in series.patches}
    assert lint(folder, tree["wheel"]) == []


def test_edit_commit_export_updates_the_series(tree, tmp_path):
    folder = tree["patches"] / f"vllm-{VERSION}"
    repo = materialise(tree["wheel"], read_series(folder), tmp_path / "work", log=lambda *_: None)
    (repo / "vllm/version.py").write_text("from ._version import __version__\n")
    with pytest.raises(BuildError, match="uncommitted changes"):
        export_patches(repo)
    git(repo, "commit", "-qam", "Third hook\n\nUpstream-Status: Pending\nOrigin: kvwarm\nDrop-When: never\n")
    write_series(folder, export_patches(repo))
    series = read_series(folder)
    assert [p.name for p in series.patches][-1] == "0003-Third-hook.patch"
    assert lint(folder, tree["wheel"]) == []


def test_hand_edited_patch_is_stale(tree):
    """A hunk whose line numbers are off still applies (git finds it nearby), but it is
    not what an export of the same commit gives: lint must say so."""
    folder = tree["patches"] / f"vllm-{VERSION}"
    patch = read_series(folder).patches[0].path
    text = patch.read_text()
    header = next(line for line in text.splitlines() if line.startswith("@@ "))
    old_start = int(header.split()[1].split(",")[0][1:])
    moved = header.replace(f"-{old_start},", f"-{old_start + 2},", 1)
    patch.write_text(text.replace(header, moved))
    problems = lint(folder, tree["wheel"])
    assert problems == [f"{folder}: {patch.name} differs from a fresh export (stale or hand-edited)"]


def test_materialise_refuses_a_dirty_or_existing_tree(tree, tmp_path):
    folder = tree["patches"] / f"vllm-{VERSION}"
    repo = materialise(tree["wheel"], read_series(folder), tmp_path / "work", log=lambda *_: None)
    (repo / "vllm/version.py").write_text("edited\n")
    with pytest.raises(BuildError, match="uncommitted changes") as err:
        materialise(tree["wheel"], read_series(folder), repo, log=lambda *_: None)
    assert "--force" in err.value.fix
    assert (repo / "vllm/version.py").read_text() == "edited\n"  # untouched
    materialise(tree["wheel"], read_series(folder), repo, force=True, log=lambda *_: None)
    assert (repo / "vllm/version.py").read_text() != "edited\n"


def test_materialise_checks_the_whole_series_first(tree, tmp_path):
    folder = tree["patches"] / f"vllm-{VERSION}"
    shutil.rmtree(folder)
    _, second = make_patches(folder, [GOOD_EDITS[0], ("Five", BLOCK_POOL, "    return 5\n", "    return 55\n")])
    second.write_text(second.read_text().replace("-    return 5\n", "-    return 555\n"))
    with pytest.raises(BuildError):
        materialise(tree["wheel"], read_series(folder), tmp_path / "work", log=lambda *_: None)
    assert not (tmp_path / "work").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".work")] == []
