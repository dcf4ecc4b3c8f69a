"""compare() and junit parsing for the upstream-tests regression gate (no vLLM needed)."""

import io
import tarfile
from pathlib import Path

import pytest

from kvwarm_build.errors import BuildError
from kvwarm_build.upstream_tests import compare, extract_tests, hub_ids, parse_junit

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="6">
  <testcase classname="tests.v1.core.test_scheduler" name="test_add_requests" time="0.1"/>
  <testcase classname="tests.v1.core.test_scheduler" name="test_schedule[True]" time="0.2">
    <failure message="AssertionError">assert 1 == 2</failure>
  </testcase>
  <testcase classname="tests.v1.core.test_scheduler" name="test_gpu_only" time="0.0">
    <skipped type="pytest.skip" message="needs CUDA"/>
  </testcase>
  <testcase classname="" name="tests.v1.core.test_scheduler_e2e" time="0.0">
    <error message="collection failure">ImportError</error>
  </testcase>
  <testcase classname="tests.v1.core.test_kv" name="test_teardown" time="0.1">
    <failure message="boom"/>
    <error message="teardown failed"/>
  </testcase>
</testsuite></testsuites>
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "junit.xml"
    path.write_text(text)
    return path


def test_parse_junit_statuses(tmp_path):
    got = parse_junit(_write(tmp_path, JUNIT))
    assert got == {
        "tests.v1.core.test_scheduler::test_add_requests": "passed",
        "tests.v1.core.test_scheduler::test_schedule[True]": "failed",
        "tests.v1.core.test_scheduler::test_gpu_only": "skipped",
        "::tests.v1.core.test_scheduler_e2e": "error",
        "tests.v1.core.test_kv::test_teardown": "error",  # error outranks failure
    }


def test_parse_junit_rejects_garbage(tmp_path):
    with pytest.raises(BuildError):
        parse_junit(_write(tmp_path, "<testsuites><testcase"))


def test_compare_finds_regressions():
    stock = {"a": "passed", "b": "passed", "c": "failed", "d": "passed", "e": "skipped"}
    patched = {"a": "passed", "b": "failed", "c": "passed", "e": "passed"}
    regressions, report = compare(stock, patched, "stock 0.28.0", "patched 0.28.0+kvwarm.1")
    assert regressions == ["b", "d"]  # d vanished on patched
    assert "stock 0.28.0: 3 passed, 1 failed, 1 skipped, 0 error" in report
    assert "patched 0.28.0+kvwarm.1: 3 passed, 1 failed, 0 skipped, 0 error" in report
    assert "  b: failed" in report and "  d: missing" in report


def test_compare_clean():
    same = {"a": "passed", "b": "failed"}
    regressions, report = compare(same, dict(same))
    assert regressions == []
    assert report.splitlines()[-1] == "no regressions"


def _sdist(tmp_path: Path) -> Path:
    path = tmp_path / "vllm-9.9.9.tar.gz"
    files = {
        "vllm-9.9.9/vllm/__init__.py": b"",
        "vllm-9.9.9/tests/v1/core/test_x.py": b'MODEL = "Qwen/Qwen1.5-7B"\n',
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_extract_tests_takes_only_tests_and_reuses(tmp_path):
    sdist = _sdist(tmp_path)
    root = extract_tests(sdist, tmp_path / "up")
    assert (root / "tests/v1/core/test_x.py").exists()
    assert not (root / "vllm").exists()  # the sdist's source must not shadow the wheel
    assert hub_ids(root, ["tests/v1/core"]) == {"Qwen/Qwen1.5-7B", "Qwen/Qwen3-0.6B"}
    (root / "tests/v1/core/test_x.py").write_text("kept")
    assert extract_tests(sdist, tmp_path / "up") == root  # reused, not re-extracted
    assert (root / "tests/v1/core/test_x.py").read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_extract_tests_refuses_foreign_dir(tmp_path):
    (tmp_path / "up").mkdir()
    with pytest.raises(BuildError):
        extract_tests(_sdist(tmp_path), tmp_path / "up")


def test_the_site_folder_is_written_once_and_repaired_when_changed(tmp_path):
    from kvwarm_build.upstream_tests import prepare_site

    site = prepare_site(tmp_path)
    shim = site / "sitecustomize.py"
    written = {p.name: p.stat().st_mtime_ns for p in site.iterdir()}
    assert set(written) == {"sitecustomize.py", "kvwarm_fixtures.py"} and shim.read_text()
    assert prepare_site(tmp_path) == site
    assert {p.name: p.stat().st_mtime_ns for p in site.iterdir()} == written  # left alone
    original = shim.read_text()
    shim.write_text("# stale\n")
    prepare_site(tmp_path)
    assert shim.read_text() == original
