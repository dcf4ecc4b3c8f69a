"""The real CPU sweeps' exports read by Dynamo's own code (ai-dynamo 1.6.1, unchanged): a
one-rank and a two-rank sweep of tests/engine/test_export_sweeps.py, read by the planner's
readers, held to the collector's conditions and the structure of Dynamo's own artifact, the
decode model fitted on the one-rank sweep; and the served-step trace's FPM capture read by
the planner's models.

Runs in the consumers venv (`nox -s consumers-S`), after the real sweeps (`-m export`, the
engine venv) left their exports in the folder KVWARM_EXPORTS names; skipped without it.
"""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
from consumers_collector import collector_problems, fixture, key_paths, structure_problems
from consumers_helpers import (
    EXPORTS_ENV,
    check_capture,
    check_fpms_decode,
    check_planner_reads_rows,
    check_profiler_reads_rows,
    feed_models,
    load,
    load_dynamo,
    residuals,
    skip_where_not_made,
    sweep_rows,
)

pytestmark = pytest.mark.consumers


@pytest.fixture(scope="module")
def dynamo():
    """The planner's readers and models (consumers_helpers.load_dynamo)."""
    return load_dynamo()


REAL = {
    "dp1": (1, ["benchmark_decode.json"]),
    "dp2": (2, ["benchmark_decode_2rank.json", "benchmark_decode_2rank_dp1.json"]),
}


@pytest.fixture(params=sorted(REAL))
def real(request):
    folder = os.environ.get(EXPORTS_ENV)
    if not folder:
        pytest.skip(f"{EXPORTS_ENV} is not set: `nox -s consumers-S` runs the real sweeps (-m export) first")
    skip_where_not_made(Path(folder))
    work = Path(folder) / request.param
    assert work.is_dir(), f"{work}: the real sweep's exports are missing; see tests/engine/test_export_sweeps.py"
    dp, fixtures = REAL[request.param]
    names = ["benchmark.json", *(f"benchmark_dp{r}.json" for r in range(1, dp))]
    return types.SimpleNamespace(
        work=work,
        dp=dp,
        fixtures=fixtures,
        files=load(work / "dynamo" / n for n in names),
        rows=sweep_rows(work / "sweep"),
    )


def test_a_real_sweeps_export_is_read_by_the_planner_and_passes_the_collector(dynamo, real, tmp_path):
    assert check_fpms_decode(dynamo, real.files) == len(real.rows[0]) * real.dp * (1 + real.dp)
    check_planner_reads_rows(dynamo, real.files, real.rows, "decode")
    check_profiler_reads_rows(dynamo, real.work / "profiler", real.rows, tmp_path)
    assert collector_problems(real.files, "decode", real.dp) == []
    for name, mine in zip(real.fixtures, real.files):
        assert structure_problems(fixture(name), mine) == [], name
        # the engine's parallel settings as vLLM resolved them: no null where Dynamo's artifact
        # of the same engine arguments has a value
        theirs, ours = key_paths(fixture(name)["engine"]["parallel"]), key_paths(mine["engine"]["parallel"])
        valued = {path for path, types_ in theirs.items() if path and "null" not in types_}
        assert sorted(path for path in valued if ours.get(path, {"null"}) == {"null"}) == [], name


def test_the_decode_model_fit_on_a_real_sweep_predicts_its_points_within_the_sweeps_spread(dynamo, real):
    """DecodeRegressionModel (the planner's default sizes) fit on the one-rank sweep's FPMs.
    The bound comes from the sweep's own spread, W = the widest range of timed steps among
    the rows it did not stamp noisy. If the step time is linear in (B, K) and each median lies
    within its point's range, a prediction is off its point's median by at most the fit's
    error (within W) plus the median's own (within W), plus what the planner's clamp of a
    negative num_decode_requests coefficient moves (a coefficient the noise made: within W
    across the batch axis): 3 W. A noisy row (its spread beyond the sweep's noisy_spread: its
    median may be polluted, as the stamp says) stays in the fit, as the planner gets it, and
    is not held to the bound.

    The two-rank sweep is not fitted: its steps (two engine cores and the collectives shim
    on two shared cores) vary more between points than with B and K, which the planner's
    model may reject (a negative coefficient); Dynamo 1.6.1's planner skips the bootstrap from
    FPMs under attention DP > 1 anyway."""
    if real.dp > 1:
        pytest.skip("the two-rank CPU sweep's timings are not a performance surface (see the docstring)")
    fpms = [f for data in real.files for f in dynamo.extract(data, dynamo.kinds["decode"])]
    errors = residuals(dynamo.Decode(64, 5, 16), fpms, "decode")
    rows = {(r["point"]["batch_size"], r["point"]["total_kv_read_tokens"]): r for r in real.rows[0]}
    s = [f.scheduled_requests for f in fpms]
    noisy = ["kvwarm_noisy" in rows[(x.num_decode_requests, x.sum_decode_kv_tokens)]["sample_reasons"] for x in s]
    quiet = [r["max_seconds"] - r["min_seconds"] for r in rows.values() if "kvwarm_noisy" not in r["sample_reasons"]]
    report = {
        "points": len(fpms),
        "noisy_points": sum(noisy),
        "max_abs_error_ms": max(abs(e) for e, n in zip(errors, noisy) if not n) * 1e3,
        "mean_abs_error_ms": sum(abs(e) for e, n in zip(errors, noisy) if not n) / (len(fpms) - sum(noisy)) * 1e3,
        "widest_quiet_range_ms": max(quiet) * 1e3,
        "bound_ms": 3 * max(quiet) * 1e3,
        "median_wall_ms": sorted(f.wall_time for f in fpms)[len(fpms) // 2] * 1e3,
    }
    print(f"decode fit on {real.work.name}: {json.dumps(report)}")
    assert report["max_abs_error_ms"] <= report["bound_ms"], report


def test_a_real_served_traces_capture_is_read_by_the_planner(dynamo):
    folder = os.environ.get(EXPORTS_ENV)
    if not folder:
        pytest.skip(f"{EXPORTS_ENV} is not set: `nox -s consumers-S` serves the traced engine (-m export) first")
    skip_where_not_made(Path(folder))
    served = Path(folder) / "served"
    assert served.is_dir(), f"{served}: the served trace's export is missing; see tests/engine/test_export_sweeps.py"
    fpms = check_capture(dynamo, served / "trace" / "fpm.jsonl")
    [current] = [p for p in (served / "trace").glob("trace-dp0-*.jsonl") if p.name.count(".") == 1]  # one launch
    steps = [json.loads(x) for x in current.read_text().splitlines()[1:]]
    assert [f.counter_id for f in fpms] == [s["step"] + 1 for s in steps]
    seen = feed_models(dynamo, fpms)
    assert seen["agg"] == len(steps) and seen["decode"] > 0 and seen["prefill"] > 0
