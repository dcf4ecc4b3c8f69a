"""The exports read by Dynamo's own code (ai-dynamo 1.6.1, unchanged), on sweeps made with the
record's own builder (decode and prefill, one and two ranks): every FPM decodes as the
planner's ForwardPassMetrics (msgspec, strict), the planner's readers give the rows back from
the artifact and from the profiler's folder, its regression models fit them; plus the
AIConfigurator fpm_forward collector's conditions on the files (its reader is not installable,
so they are checked here, as docs/export.md lists them: consumers_collector.py) and the
structure of the real self-benchmark artifacts in tests/fixtures/dynamo-1.6.1; and a served-step
trace's FPM capture decoded and learnt from as a live one.

Runs in the consumers venv (`nox -s consumers-S`): ai-dynamo --no-deps, msgspec, numpy,
scikit-learn, pydantic; no vLLM, the overlay's record room on the path (plain data). The real
CPU sweeps' exports are read in test_export_consumers_real.py.
"""

from __future__ import annotations

import json
import os
import re
import types
from pathlib import Path

import pytest
from consumers_collector import collector_problems, fixture, structure_problems
from consumers_helpers import (
    DECODE_POINTS,
    JITTER,
    PREFILL_POINTS,
    check_capture,
    check_fpms_decode,
    check_planner_reads_rows,
    check_profiler_reads_rows,
    export_dynamo,
    export_profiler,
    feed_models,
    load,
    load_dynamo,
    made_sweep,
    residuals,
    sweep_rows,
)

pytestmark = pytest.mark.consumers


@pytest.fixture(scope="module")
def dynamo():
    """The planner's readers and models (consumers_helpers.load_dynamo)."""
    return load_dynamo()


# --- made sweeps ---------------------------------------------------------------------------
CASES = {  # name: (kinds, dp, the fixture of the same shape per kind)
    "decode": (("decode",), 1, {"decode": ["benchmark_decode.json"]}),
    "prefill": (("prefill",), 1, {"prefill": ["benchmark_prefill.json", "benchmark_prefill_fake.json"]}),
    "decode_dp2": (("decode",), 2, {"decode": ["benchmark_decode_2rank.json", "benchmark_decode_2rank_dp1.json"]}),
    "both": (("decode", "prefill"), 1, {"decode": ["benchmark_decode.json"], "prefill": ["benchmark_prefill.json"]}),
}


@pytest.fixture(params=sorted(CASES))
def made(request, tmp_path):
    kinds, dp, fixtures = CASES[request.param]
    root = made_sweep(tmp_path / "sweep", kinds, dp)
    written = export_dynamo(root, tmp_path / "dynamo" / "benchmark.json")
    files = {}
    for kind in kinds:
        stem = "benchmark" if len(kinds) == 1 else f"benchmark_{kind}"
        names = [f"{stem}.json", *(f"{stem}_dp{r}.json" for r in range(1, dp))]
        files[kind] = load(tmp_path / "dynamo" / name for name in names)
    assert sorted(written) == sorted(tmp_path / "dynamo" / n for n in os.listdir(tmp_path / "dynamo"))
    return types.SimpleNamespace(root=root, kinds=kinds, dp=dp, files=files, fixtures=fixtures, tmp=tmp_path)


def test_every_exported_fpm_decodes_as_the_planners_struct(dynamo, made):
    counts = {kind: check_fpms_decode(dynamo, files) for kind, files in made.files.items()}
    points = {"decode": len(DECODE_POINTS), "prefill": len(PREFILL_POINTS)}
    assert counts == {kind: points[kind] * made.dp * (1 + made.dp) for kind in made.kinds}
    # the strictness the check relies on: a count written 4.0 is refused
    raw = made.files[made.kinds[0]][0]["results"][0]["fpms"][0]
    bad = {**raw, "scheduled_requests": {**raw["scheduled_requests"], "num_decode_requests": 4.0}}
    with pytest.raises(dynamo.msgspec.ValidationError):
        dynamo.msgspec.json.decode(json.dumps(bad).encode(), type=dynamo.FPM)


def test_the_planners_reader_gives_every_row_back(dynamo, made):
    rows = sweep_rows(made.root)
    for kind, files in made.files.items():
        fpms = check_planner_reads_rows(dynamo, files, rows, kind)
        assert len(fpms) == made.dp * len(DECODE_POINTS if kind == "decode" else PREFILL_POINTS)


def test_the_planners_converter_reads_the_profiler_folder_back(dynamo, made):
    export_profiler(made.root, made.tmp / "profiler")
    check_profiler_reads_rows(dynamo, made.tmp / "profiler", sweep_rows(made.root), made.tmp)


def test_the_regression_models_fit_every_row_the_planner_reads(dynamo, made):
    """The planner's models on every FPM its reader gives, as the planner feeds them (it drops
    none). Rows made from a linear law the model sees, each sample within +-JITTER of it: the
    fit predicts every row within that band plus the median's own jitter. Prefill rows with a
    prefix (P > 0) cost more by a term in P, which the prefill model does not see (N only:
    docs/export.md): the fit over every row cannot hold them, as the planner's cannot; over
    the rows without a prefix it finds their law."""
    for kind, files in made.files.items():
        fpms = [f for data in files for f in dynamo.extract(data, dynamo.kinds[kind])]
        prefixed = [kind == "prefill" and f.scheduled_requests.sum_prefill_kv_tokens > 0 for f in fpms]
        model = dynamo.Decode(64, 5, 16) if kind == "decode" else dynamo.Prefill(64, 5, 16)
        relative = [abs(e) / f.wall_time for e, f in zip(residuals(model, fpms, kind), fpms)]
        if not any(prefixed):
            assert max(relative) <= 2 * JITTER
            continue
        assert max(r for r, p in zip(relative, prefixed) if p) > 2 * JITTER  # what the planner's fit does
        plain = [f for f, p in zip(fpms, prefixed) if not p]
        errors = residuals(dynamo.Prefill(64, 5, 16), plain, kind)
        assert max(abs(e) / f.wall_time for e, f in zip(errors, plain)) <= 2 * JITTER


def test_a_sweep_of_both_kinds_has_both_at_the_path_as_dynamos_agg_mode(dynamo, tmp_path):
    """The file at the path (every rank's) holds both kinds, as Dynamo's agg run writes it:
    the planner takes its component's rows from it; the collector, one kind per cell, does not."""
    root = made_sweep(tmp_path / "sweep", ("decode", "prefill"), 2)
    export_dynamo(root, tmp_path / "d" / "benchmark.json")
    agg = load(tmp_path / "d" / name for name in ("benchmark.json", "benchmark_dp1.json"))
    assert [f["config"]["mode"] for f in agg] == ["agg", "agg"]
    assert check_fpms_decode(dynamo, agg) == 2 * (len(DECODE_POINTS) + len(PREFILL_POINTS)) * 3
    rows = sweep_rows(root)
    for kind, points in (("decode", DECODE_POINTS), ("prefill", PREFILL_POINTS)):
        got = [f for data in agg for f in dynamo.extract(data, dynamo.kinds[kind])]
        assert len(got) == 2 * len(points)
        want = sorted(r["median_seconds"] for rank in rows for r in rank if r["point"].get("point_type") == kind)
        assert sorted(f.wall_time for f in got) == want
    ids = [r["point"]["benchmark_id"] for r in agg[0]["results"]]
    assert ids == list(range(1, len(ids) + 1))  # prefill then decode, numbered on
    assert collector_problems(agg, "decode", 2) != [] and collector_problems(agg, "prefill", 2) != []


def test_a_complete_export_passes_every_condition_of_the_collector(made):
    for kind, files in made.files.items():
        assert collector_problems(files, kind, made.dp) == []
        assert collector_problems(files, "prefill" if kind == "decode" else "decode", made.dp) != []


def test_the_export_has_every_key_of_dynamos_artifact_with_its_json_type(made):
    for kind, names in made.fixtures.items():
        ours = made.files[kind]
        pairs = zip(names, ours) if made.dp > 1 else ((name, ours[0]) for name in names)
        for name, mine in pairs:
            assert structure_problems(fixture(name), mine) == [], name
        for mine in ours:  # what the export says it cannot fill is null, nothing else
            for path in mine["kvwarm_sweep"]["unfilled"]:
                assert _at(mine, path) is None, path


def _at(doc, path: str):
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        doc = doc[int(part[1:-1])] if part.startswith("[") else doc[part]
    return doc


def test_a_skipped_point_or_a_failed_sweep_fails_the_collector_as_dynamos_own_would(tmp_path):
    skipped = made_sweep(tmp_path / "skipped", skipped=True)
    (artifact,) = load(export_dynamo(skipped, tmp_path / "a" / "benchmark.json"))
    assert (artifact["status"], artifact["valid"], artifact["usable"]) == ("complete", False, False)
    assert artifact["coverage"] == {"expected_points": 13, "completed_points": 12, "skipped_points": 1}
    problems = collector_problems([artifact], "decode", 1)
    assert "rank 0: valid true" in problems and "rank 0: skipped_points == []" in problems
    failed = made_sweep(tmp_path / "failed", status="failed")
    (artifact,) = load(export_dynamo(failed, tmp_path / "b" / "benchmark.json"))
    assert (artifact["status"], artifact["valid"], artifact["error"]) == (
        "failed",
        False,
        "RuntimeError: the engine stopped",
    )
    assert "rank 0: error null" in collector_problems([artifact], "decode", 1)


def test_the_probes_own_fixture_passes_the_collector_checks():
    """The checks' own oracle: Dynamo's real rank files pass them."""
    assert collector_problems([fixture("benchmark_decode.json")], "decode", 1) == []
    assert collector_problems([fixture("benchmark_prefill.json")], "prefill", 1) == []
    pair = [fixture("benchmark_decode_2rank.json"), fixture("benchmark_decode_2rank_dp1.json")]
    assert collector_problems(pair, "decode", 2) == []
    assert "the ranks are exactly 0..1" in collector_problems(pair[:1], "decode", 2)


def test_the_checks_see_what_they_check(tmp_path):
    """The oracles' own check: a key removed, a type changed, a wrong counter or group time."""
    import copy

    files = load(export_dynamo(made_sweep(tmp_path / "s", dp=2), tmp_path / "d" / "benchmark.json"))
    theirs = fixture("benchmark_decode_2rank.json")
    broken = copy.deepcopy(files[0])
    del broken["limits"]["block_size"]
    broken["results"][0]["fpms"][0]["counter_id"] = "1"
    assert structure_problems(theirs, broken) == [
        "limits.block_size: missing",
        "results[].fpms[].counter_id: ['integer', 'string'] where Dynamo writes ['integer']",
    ]
    assert "rank 0: results[0].fpms[0]: counter_id == benchmark_id" in collector_problems(
        [broken, files[1]], "decode", 2
    )
    slow = copy.deepcopy(files)
    for f in slow:
        f["iteration_groups"][0]["wall_time"] *= 1.5
    problems = collector_problems(slow, "decode", 2)
    assert "rank 0: iteration_groups[0]: wall == the ranks' max exactly (the worker's merge)" in problems
    assert "rank 1: measured_iteration_seconds == the sum of the group wall times" in problems


# --- a served-step trace as Dynamo's forward-pass metrics capture ---------------------------
def made_trace_lines(root: Path) -> Path:
    """A two-rank trace in the recorder's format (docs/validate-reference.md#the-trace), written here:
    decode, prefill and mixed steps, a step after an idle wait (no wall, its span)."""
    root.mkdir(parents=True)
    for rank in range(2):
        header = {"type": "kvwarm_trace", "schema_version": 1, "rank": rank, "dp_size": 2}
        header.update(started_at="2026-12-04T10:00:00.250000Z", timing={"basis": "update_to_update"})
        lines = [header]
        for n in range(30):
            b, p = (n % 4) + 1, 200 * (n % 3 == 0)
            wall = None if n in (0, 12) else 0.004 + 0.0002 * b + 1e-6 * 100 * b * n + 2e-6 * p
            lines.append(
                {
                    "step": n,
                    "at": 0.01 * n + 0.001 * rank,
                    "wall": wall,
                    "span": 0.005,
                    "decode": {"requests": b, "kv_tokens": 100 * b * n, "kv_var": 25.0 * n},
                    "prefill": {"requests": int(p > 0), "new_tokens": p, "prefix_tokens": 0, "prompt_var": 0.0},
                    "queued": {"requests": 2, "tokens": 900, "var": 40000.0, "resuming": 0},
                }
            )
        (root / f"trace-dp{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


def test_a_traces_fpms_decode_as_the_planners_struct_and_its_models_learn_them(dynamo, tmp_path):
    from vllm.kvwarm.record.export.fpm import write_fpm

    path, left_out, _ = write_fpm(made_trace_lines(tmp_path / "trace"))
    fpms = check_capture(dynamo, path)
    assert left_out == 0 and len(fpms) == 60
    assert [(f.dp_rank, f.counter_id) for f in fpms[:4]] == [(0, 1), (1, 1), (0, 2), (1, 2)]
    assert all(f.wall_time == 0.005 for f in fpms if f.counter_id in (1, 13))  # the span after an idle wait
    seen = feed_models(dynamo, fpms)
    assert seen == {"decode": 40, "prefill": 0, "agg": 60}
    decode = dynamo.Decode(256, 5, 16)
    decode.load_benchmark_fpms([f for f in fpms if not f.scheduled_requests.num_prefill_requests])
    assert decode._ensure_fitted()
