"""Benchmarks that cannot rot: CI and the matrix run every benchmark's quick mode on the
newest release with a CPU engine, and each must end with its result line."""

from __future__ import annotations

import ast
import dataclasses
import json

import pytest
from test_release_table import _cpu_release

from kvwarm_build import project, sessions
from kvwarm_build.errors import BuildError

RESULT = {"metric": "m", "value": 1.0, "unit": "s", "baseline": 2.0, "ratio": 0.5, "target": "ratio <= 1"}


def test_the_bench_session_takes_benchmark_names_the_quick_flag_and_the_scripts_arguments():
    assert sessions.bench_arguments([]) == ([], False, [])
    assert sessions.bench_arguments(["--quick"]) == ([], True, [])
    assert sessions.bench_arguments(["step_fidelity", "--quick", "build_time"]) == (
        ["step_fidelity", "build_time"],
        True,
        [],
    )
    assert sessions.bench_arguments(["step_fidelity", "--", "--only", "dense", "--"]) == (
        ["step_fidelity"],
        False,
        ["--only", "dense", "--"],
    )
    with pytest.raises(BuildError) as err:
        sessions.bench_arguments(["--fast"])
    assert "--fast" in err.value.problem and "--quick" in err.value.fix and "`--`" in err.value.fix


def test_a_benchmark_is_quick_by_its_flag_or_the_sessions_variable():
    assert not sessions.quick_mode(["b.py"], {})
    assert sessions.quick_mode(["b.py", "--quick"], {})
    assert sessions.quick_mode(["b.py"], {sessions.QUICK_ENV: "1"})
    assert not sessions.quick_mode(["b.py"], {sessions.QUICK_ENV: "0"})
    assert not sessions.quick_mode(["--quick"], {})  # argv[0] is the script


@pytest.mark.parametrize("plan_of", [sessions.ci_plan, sessions.matrix_plan])
def test_ci_and_the_matrix_run_every_quick_mode_once_on_the_newest_release_with_a_cpu_engine(tree, plan_of):
    older = _cpu_release(tree, short="9.8", version="9.8.0")
    newest = _cpu_release(tree)
    no_cpu = dataclasses.replace(newest, short="9.10", version="9.10.0", flavours={"cuda": newest.flavour("cuda")})
    plan = dict(plan_of([older, newest, no_cpu]))
    assert [name for name in plan if name.startswith("bench-")] == ["bench-9.9"]
    assert plan["bench-9.9"] == [sessions.QUICK_FLAG]
    assert not [n for n in dict(plan_of([no_cpu])) if n.startswith("bench-")]


def test_the_result_line_is_the_last_line_and_holds_every_key():
    assert sessions.result_line("progress\n" + json.dumps(RESULT) + "\n\n", "b") == RESULT
    without_ratio = json.dumps({k: v for k, v in RESULT.items() if k != "ratio"})
    for broken in ("progress only", without_ratio, "", json.dumps(RESULT) + "\ntraceback at the end"):
        with pytest.raises(BuildError) as err:
            sessions.result_line(f"start\n{broken}", "b")
        assert "benchmark b" in err.value.problem and "--quick" in err.value.fix


def _calls(script, name: str) -> bool:
    tree = ast.parse(script.read_text())
    return any(
        isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) == name for n in ast.walk(tree)
    )


def test_every_benchmark_of_the_project_has_a_quick_mode():
    folder = project.ROOT / "benchmarks"
    scripts = sorted(folder.glob("[!_]*.py"))
    assert scripts
    without = [s.name for s in scripts if not _calls(s, "quick_mode")]
    assert without == [], f"benchmarks without a quick mode (kvwarm_build.sessions.quick_mode): {without}"
