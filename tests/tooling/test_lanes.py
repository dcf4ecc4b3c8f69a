"""`nox -s matrix` in lanes: how sessions are dealt out, and the runner on real processes."""

from __future__ import annotations

import sys

import pytest

from kvwarm_build import lanes
from kvwarm_build.errors import BuildError


def test_a_lane_takes_whole_kinds_longest_first_and_keeps_the_plan_order():
    plan = [("lint-patches", None), ("builds", ["--check-reproducible", "9.9"])]
    plan += [(f"{kind}-9.{n}", None) for kind in ("upstream-tests", "unit", "image-standin") for n in (8, 9)]
    plan += [("bench-9.9", ["--quick"])]
    first, dealt = lanes.split(plan, 2)
    assert first == plan[:2]
    # longest first, each to the lighter lane: images (12 min), gates (10), units (8) beside
    # the gates (18), bench (5) beside the images (17)
    assert [[name for name, _ in lane] for lane in dealt] == [
        ["image-standin-9.8", "image-standin-9.9", "bench-9.9"],
        ["upstream-tests-9.8", "upstream-tests-9.9", "unit-9.8", "unit-9.9"],
    ]
    assert dealt[0][-1] == ("bench-9.9", ["--quick"])
    one = lanes.split(plan, 1)[1]
    assert one == [plan[2:]]


def test_kind_of_drops_only_a_release():
    assert lanes.kind_of("image-standin-9.9") == "image-standin"
    assert lanes.kind_of("upstream-tests-10.1") == "upstream-tests"
    assert lanes.kind_of("lint-patches") == "lint-patches"


@pytest.mark.parametrize("posargs", [["--lanes"], ["--lanes", "0"], ["--lanes", "two"], ["--jobs", "2"]])
def test_bad_lanes_arguments_name_the_fix(posargs):
    with pytest.raises(BuildError, match="--lanes N"):
        lanes.lanes_arguments(posargs)


def test_lanes_arguments_default_to_two():
    assert lanes.lanes_arguments([]) == 2
    assert lanes.lanes_arguments(["--lanes", "3"]) == 3


def _command(name, posargs):
    code = 1 if name.startswith("unit") else 0
    return [sys.executable, "-c", f"import sys; print('ran', {name!r}, {posargs!r}); sys.exit({code})"]


def test_run_plan_runs_every_session_reports_the_failed_and_leads_each_line(capsys):
    plan = [("builds", None), ("unit-9.8", None), ("image-standin-9.8", None), ("bench-9.9", ["--quick"])]
    failed = lanes.run_plan(plan, 2, _command)
    out = capsys.readouterr().out
    assert failed == ["unit-9.8"]
    assert "[bench-9.9] ran bench-9.9 ['--quick']" in out
    assert "[image-standin-9.8] ran image-standin-9.8 None" in out
    assert "matrix: unit-9.8 FAILED (exit 1)" in out


def test_a_failed_first_session_stops_the_lanes(capsys):
    plan = [("builds", None), ("image-standin-9.8", None)]
    failed = lanes.run_plan(plan, 2, lambda name, posargs: [sys.executable, "-c", "raise SystemExit(3)"])
    assert failed == ["builds"]
    assert "the lanes did not start" in capsys.readouterr().out


def test_run_plan_tells_each_sessions_end_with_its_status():
    plan = [("lint-patches", None), ("unit-9.9", None), ("engine-9.9", None)]
    ends = []

    def command(name, posargs):
        return [sys.executable, "-c", f"raise SystemExit({3 if name == 'engine-9.9' else 0})"]

    lanes.run_plan(plan, 2, command, lambda name, code: ends.append((name, code)))
    assert sorted(ends) == [("engine-9.9", 3), ("lint-patches", 0), ("unit-9.9", 0)]


def test_each_matrix_session_runs_in_a_nox_of_its_own_with_its_own_venvs(tmp_path):
    noxfile, envdir = tmp_path / "noxfile.py", tmp_path / "envs" / "unit-9.9"
    head = [sys.executable, "-m", "nox", "-f", str(noxfile), "--envdir", str(envdir), "-s", "unit-9.9"]
    assert lanes.nox_command(noxfile, envdir, "unit-9.9", None) == head
    assert lanes.nox_command(noxfile, envdir, "unit-9.9", ["--quick"]) == [*head, "--", "--quick"]
