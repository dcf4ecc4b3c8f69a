"""compare(), junit parsing, the test selection and the platform of the upstream-tests regression gate
(no vLLM needed)."""

import dataclasses
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kvwarm_build.errors import BuildError
from kvwarm_build.releases import load_releases
from kvwarm_build.upstream.suite import (
    CONNECTOR_UNIT,
    CORE,
    SITE_FILES,
    Selection,
    compare,
    extract_tests,
    gate,
    gate_env,
    hub_ids,
    parse_junit,
    prepare_site,
    run_gate,
)

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
    regressions, report = compare(stock, patched, "stock 9.9.9", "patched 9.9.9+kvwarm.1")
    assert regressions == ["b", "d"]  # d vanished on patched
    assert "stock 9.9.9: 3 passed, 1 failed, 1 skipped, 0 error" in report
    assert "patched 9.9.9+kvwarm.1: 3 passed, 1 failed, 0 skipped, 0 error" in report
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
    assert hub_ids(root, [Selection("core", ("tests/v1/core",))]) == {"Qwen/Qwen1.5-7B", "Qwen/Qwen3-0.6B"}
    (root / "tests/v1/core/test_x.py").write_text("kept")
    assert extract_tests(sdist, tmp_path / "up") == root  # reused, not re-extracted
    assert (root / "tests/v1/core/test_x.py").read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_extract_tests_refuses_foreign_dir(tmp_path):
    (tmp_path / "up").mkdir()
    with pytest.raises(BuildError):
        extract_tests(_sdist(tmp_path), tmp_path / "up")


def test_the_site_folder_is_written_once_and_repaired_when_changed(tmp_path):
    site = prepare_site(tmp_path)
    shim = site / "sitecustomize.py"
    written = {p.name: p.stat().st_mtime_ns for p in site.iterdir()}
    assert set(written) == {name for _, name in SITE_FILES} and shim.read_text()
    assert prepare_site(tmp_path) == site
    assert {p.name: p.stat().st_mtime_ns for p in site.iterdir()} == written  # left alone
    original = shim.read_text()
    shim.write_text("# stale\n")
    prepare_site(tmp_path)
    assert shim.read_text() == original


MARKED = """import pytest
pytestmark = pytest.mark.cpu_test
def test_fast(): pass
@pytest.mark.parametrize("n", [1, 2])
def test_priority_scheduling_blast(n): pass
"""


def _tests_tree(root: Path) -> Path:
    files = {
        f"{CORE}/test_marked.py": MARKED,
        f"{CORE}/test_unmarked.py": "def test_plain(): pass\n",
        f"{CORE}/sub/test_deeper.py": "def test_deeper(): pass\n",
        f"{CORE}/test_scheduler_e2e.py": "def test_engine(): raise SystemExit('an e2e test must not run')\n",
        f"{CONNECTOR_UNIT}/conftest.py": "import pytest\n@pytest.fixture\ndef connector(): return 1\n",
        f"{CONNECTOR_UNIT}/test_connector.py": "def test_connector(connector): assert connector == 1\n",
        f"{CONNECTOR_UNIT}/test_needs_pkg.py": "import kvwarm_no_such_package\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_gate_selects_marked_core_unmarked_core_without_e2e_and_the_connector_units(tmp_path):
    root = _tests_tree(tmp_path)
    runs = gate(root)
    assert [r.paths for r in runs] == [
        (CORE,),
        (f"{CORE}/sub/test_deeper.py", f"{CORE}/test_unmarked.py"),
        (CONNECTOR_UNIT,),
    ]
    assert runs[0].args[:2] == ("-m", "cpu_test")
    assert all("not test_priority_scheduling_blast" in r.args for r in runs)
    assert all("not test_priority_scheduling_blast" not in r.args for r in gate(root, full=True))
    assert [r.conftest_root for r in runs] == [CORE, CORE, CONNECTOR_UNIT]


def test_a_tree_without_connector_tests_leaves_that_selection_out(tmp_path):
    (tmp_path / CORE).mkdir(parents=True)
    (tmp_path / CORE / "test_marked.py").write_text(MARKED)
    assert [r.name for r in gate(tmp_path)] == ["core cpu_test"]


@pytest.mark.parametrize("full", [False, True])
def test_run_gate_runs_each_selection_and_keeps_a_missing_package_a_failure(tmp_path, full):
    root = _tests_tree(tmp_path / "src")
    runs, env = gate(root, full=full), gate_env(cpu_platform=True)
    results = run_gate(sys.executable, root, tmp_path / "side", tmp_path / "hf", runs, platform_env=env)
    stress = {f"tests.v1.core.test_marked::test_priority_scheduling_blast[{n}]" for n in (1, 2)}
    expected = {
        "tests.v1.core.test_marked::test_fast",
        "tests.v1.core.test_unmarked::test_plain",
        "tests.v1.core.sub.test_deeper::test_deeper",
        "tests.v1.kv_connector.unit.test_connector::test_connector",
        *(stress if full else ()),
    }
    assert {t for t, s in results.items() if s == "passed"} == expected
    # A module whose package is missing is an error entry on this side (and on the other):
    # compare() never counts it as a regression.
    assert [s for t, s in results.items() if "test_needs_pkg" in t] == ["error"]
    assert compare(results, dict(results))[0] == []


PLATFORM_PROBES = """import os
import pytest
pytestmark = pytest.mark.cpu_test
def test_cpu_platform(): assert os.environ.get("VLLM_TARGET_DEVICE") == "cpu"
def test_refusal_lifted(): assert os.environ.get("KVWARM_CPU_PLATFORM_WITHOUT_TRITON") == "1"
"""


@pytest.mark.parametrize("cpu_platform", [True, False])
def test_the_gate_runs_on_the_cpu_platform_lifting_the_refusal_where_the_row_says_never_the_caller_s(
    tree, tmp_path, monkeypatch, cpu_platform
):
    path = tree["root"] / "releases.toml"
    if not cpu_platform:
        path.write_text(path.read_text().replace("build = 3", "build = 3\ncpu_platform = false"))
    (release,) = load_releases(path)
    root = tmp_path / "src"
    (root / CORE).mkdir(parents=True)
    (root / CORE / "test_platform.py").write_text(PLATFORM_PROBES)
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cuda")
    monkeypatch.setenv("KVWARM_CPU_PLATFORM_WITHOUT_TRITON", "1")
    env = gate_env(release.cpu_platform)
    results = run_gate(sys.executable, root, tmp_path / "side", tmp_path / "hf", gate(root), platform_env=env)
    module = "tests.v1.core.test_platform"
    assert results == {
        f"{module}::test_cpu_platform": "passed",
        f"{module}::test_refusal_lifted": "failed" if cpu_platform else "passed",
    }


CPU_PLATFORM = """class CpuPlatform:
    @classmethod
    def check_and_update_config(cls, vllm_config):
        if vllm_config == "x86 without triton":
            REFUSAL
        return "checked"
"""


@pytest.mark.parametrize("switch, refusal, expected", [
    ("1", True, "checked"),
    ("", True, "RuntimeError: vLLM on x86 CPUs requires Triton (triton-cpu)."),
    ("1", False, "ImportError"),  # nothing to lift: the row's cpu_platform no longer fits
    ("", False, "checked"),
])  # fmt: skip
def test_the_shim_lifts_the_cpu_platform_s_x86_triton_refusal_and_only_that(tmp_path, switch, refusal, expected):
    from kvwarm_build.upstream._cpu_platform_shim import REFUSAL

    fake = tmp_path / "fake" / "vllm" / "platforms"
    fake.mkdir(parents=True)
    for init in (fake / "__init__.py", fake.parent / "__init__.py"):
        init.write_text("")
    (fake / "cpu.py").write_text(CPU_PLATFORM.replace("REFUSAL", REFUSAL if refusal else "raise SystemExit(3)"))
    site = prepare_site(tmp_path)
    probe = (
        "from vllm.platforms.cpu import CpuPlatform\n"
        "try: print(CpuPlatform.check_and_update_config('x86 without triton' if " + repr(refusal) + " else 'x'))\n"
        "except Exception as e: print(f'{type(e).__name__}: {e}')\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{fake.parent.parent}"}
    env["KVWARM_CPU_PLATFORM_WITHOUT_TRITON"] = switch
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=False)
    assert expected in run.stdout + run.stderr, run.stderr


def test_stock_results_of_one_platform_are_not_reused_on_the_other(tree, tmp_path):
    from kvwarm_build.upstream.run import _stock_key

    (release,) = load_releases(tree["root"] / "releases.toml")
    runs = gate(_tests_tree(tmp_path / "src"))
    deps_site = tmp_path / "venvs" / "deps-9.9.1-abc" / "lib" / "python3.11" / "site-packages"
    on_cpu = _stock_key(release, "cuda", runs, deps_site)
    assert _stock_key(release, "cuda", runs, deps_site) == on_cpu
    assert _stock_key(dataclasses.replace(release, cpu_platform=False), "cuda", runs, deps_site) != on_cpu


def test_torchvision_goes_with_the_torch_of_the_deps_venv():
    from kvwarm_build.upstream.suite import torchvision_for

    assert torchvision_for("2.20.0+cpu") == "torchvision==0.35.0"
    assert torchvision_for("2.21.1") == "torchvision==0.36.0"
    with pytest.raises(BuildError, match="torch 3.0.0"):
        torchvision_for("3.0.0")
