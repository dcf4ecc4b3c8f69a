"""Maintainer round trip on a tiny release: materialise, edit, export, lint staleness."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import BLOCK_POOL, GOOD_EDITS, VERSION, git, make_patches

from kvwarm_build import project
from kvwarm_build.builds.maint import (
    export_patches,
    lint,
    lint_releases,
    materialise,
    names_across_releases,
    write_series,
)
from kvwarm_build.builds.series import patch_file_name, read_series, series_folder
from kvwarm_build.errors import BuildError
from kvwarm_build.releases import load_releases


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
    assert [p.name for p in series.patches][-1] == "third-hook.patch"
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


# --- patch file names -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "subject, name",
    [
        (
            "kvwarm hook: never hash the blocks of a borrowed request",
            "kvwarm-hook-never-hash-the-blocks-of-a-borrowed-request.patch",
        ),
        (
            "Backport KVCacheManager.take_kv_cache_block_copies from vLLM 1.2.3",
            "backport-kvcachemanager.take_kv_cache_block_copies-from-vllm-1.2.3.patch",
        ),
        ("Backport the scheduler's copy-on-write hand-off", "backport-the-scheduler-s-copy-on-write-hand-off.patch"),
        ("  [tooling] Refuse it, please...  ", "tooling-refuse-it-please.patch"),
        ("Ünïcode — dashes", "n-code-dashes.patch"),
    ],
)
def test_a_patch_file_is_named_by_its_whole_subject(subject, name):
    assert patch_file_name(subject) == name


@pytest.mark.parametrize("subject", ["", "!!! ???", "—", "x" * 201])
def test_a_subject_that_gives_no_usable_name_is_refused_with_the_fix(subject):
    with pytest.raises(BuildError) as err:
        patch_file_name(subject)
    assert repr(subject) in err.value.problem and "subject" in err.value.fix


def test_export_names_each_patch_from_its_whole_subject_without_cutting(tree, tmp_path):
    folder = tree["patches"] / f"vllm-{VERSION}"
    repo = materialise(tree["wheel"], read_series(folder), tmp_path / "work", log=lambda *_: None)
    subject = "kvwarm hook: a subject longer than the sixty-four characters git format-patch keeps"
    (repo / "vllm/version.py").write_text("from ._version import __version__\n")
    git(repo, "commit", "-qam", f"{subject}\n\nUpstream-Status: Pending\nOrigin: kvwarm\nDrop-When: never\n")
    exported = export_patches(repo)
    assert list(exported) == [
        "add-a-hook-to-helper_3.patch",
        "add-a-new-module.patch",
        "kvwarm-hook-a-subject-longer-than-the-sixty-four-characters-git-format-patch-keeps.patch",
    ]
    assert f"Subject: {subject[:60]}" in exported[list(exported)[-1]].decode()


def test_export_renames_an_old_numbered_series_and_a_second_export_changes_nothing(tree, tmp_path):
    """A series from before the naming rule (format-patch's NNNN- names, cut at 64
    characters) comes out of one round trip under the rule, with the same bytes."""
    folder = tree["patches"] / f"vllm-{VERSION}"
    old = {}
    for index, patch in enumerate(read_series(folder).patches, start=1):
        renamed = folder / f"{index:04d}-{patch.name[:10]}.patch"
        patch.path.rename(renamed)
        old[renamed.name] = renamed.read_bytes()
    (folder / "series").write_text("".join(f"{name}\n" for name in old))
    assert lint(folder, None) == [
        f"{folder / name}: its subject gives the file name {expected}: rename the file and its series entry "
        "(tree-S then export-S rename every patch of a release)"
        for name, expected in zip(old, ["add-a-hook-to-helper_3.patch", "add-a-new-module.patch"])
    ]
    repo = materialise(tree["wheel"], read_series(folder), tmp_path / "work", log=lambda *_: None)
    write_series(folder, export_patches(repo))
    assert (folder / "series").read_text() == "add-a-hook-to-helper_3.patch\nadd-a-new-module.patch\n"
    assert sorted(p.name for p in folder.glob("*.patch")) == ["add-a-hook-to-helper_3.patch", "add-a-new-module.patch"]
    assert [p.data() for p in read_series(folder).patches] == list(old.values())
    assert lint(folder, tree["wheel"]) == []
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    write_series(folder, export_patches(repo))
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_export_refuses_two_commits_whose_subjects_give_one_name(tree, tmp_path):
    folder = tree["patches"] / f"vllm-{VERSION}"
    repo = materialise(tree["wheel"], read_series(folder), tmp_path / "work", log=lambda *_: None)
    (repo / "vllm/version.py").write_text("from ._version import __version__\n")
    git(repo, "commit", "-qam", "Add a new module!\n\nUpstream-Status: Pending\nOrigin: kvwarm\nDrop-When: never\n")
    with pytest.raises(BuildError) as err:
        export_patches(repo)
    assert "add-a-new-module.patch" in err.value.problem and "reword" in err.value.fix


def test_lint_names_a_patch_whose_name_differs_between_releases(tree):
    first = tree["patches"] / f"vllm-{VERSION}"
    second = tree["patches"] / "vllm-9.9.2"
    shutil.copytree(first, second)
    (second / "add-a-new-module.patch").rename(second / "new-module.patch")
    (second / "series").write_text("add-a-hook-to-helper_3.patch\nnew-module.patch\n")
    (problem,) = names_across_releases([first, second])
    assert problem == (
        "the patch 'Add a new module' has different file names: add-a-new-module.patch in vllm-9.9.1; "
        "new-module.patch in vllm-9.9.2"
    )


def test_every_series_of_the_project_follows_the_naming_rule_with_one_name_per_patch():
    """The hooks every release carries have one file name, so the docs can name them once."""
    releases = load_releases(project.RELEASES)
    assert lint_releases(releases, project.PATCHES, log=lambda *_: None) == []
    names = [{p.name for p in read_series(series_folder(project.PATCHES, r.version)).patches} for r in releases]
    hooks = [{n for n in found if n.startswith("kvwarm-hook-")} for found in names]
    assert hooks[0] and all(h == hooks[0] for h in hooks)


def test_lint_patches_release_option_limits_the_staleness_check_to_those_releases(monkeypatch):
    """A port lints its new series against a fresh export without downloading every other
    release's wheel; the other checks still see every release."""
    from kvwarm_build import cli

    releases = load_releases(project.RELEASES)
    fetched, seen = [], []
    monkeypatch.setattr(cli, "fetch", lambda artifact, *a, **k: fetched.append(artifact.file) or Path(artifact.file))

    def lint_all(rows, patches, upstream_of, log):
        seen.extend(r.version for r in rows)
        wheels = [upstream_of(r) if upstream_of else None for r in rows]
        return [f"{r.version} checked against {wheel}" for r, wheel in zip(rows, wheels) if wheel is not None]

    monkeypatch.setattr(cli, "lint_releases", lint_all)
    assert cli.main(["lint-patches", "--release", releases[-1].short]) == 1  # lint_all's one "problem"
    assert seen == [r.version for r in releases]
    assert fetched == [releases[-1].flavour("cuda").wheel.file]
    fetched.clear()
    assert cli.main(["lint-patches", "--no-staleness"]) == 0 and fetched == []
