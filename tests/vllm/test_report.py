"""`python -m vllm.kvwarm report`: artifacts of schema v1 and v2 rendered into a page, a CSV
and PNG plots (matplotlib figures inspected, not pixels), failed and running artifacts, and
every bad input named. The A/B comparison: test_report_compare.py."""

from __future__ import annotations

import csv
import sys

import pytest
from report_helpers import LAYOUT, RUN, as_schema_2, legend, rank_artifact, save, v1_artifact
from vllm.kvwarm.record.artifact import KvwarmMeta, PointRow, build_artifact
from vllm.kvwarm.record.plot import REGIMES, figure, plot_png
from vllm.kvwarm.record.report import run
from vllm.kvwarm.record.runs import from_artifact, load_run
from vllm.kvwarm.record.schema import validate
from vllm.kvwarm.sweep.rows import NOISY_SPREAD


def test_a_v1_artifact_renders_with_unknown_build_and_layout(tmp_path, capsys):
    source = save(tmp_path / "moe", v1_artifact())
    assert run([source, "--out", str(tmp_path / "report")]) == 0
    out = capsys.readouterr().out
    assert "4 measured point(s), tiny-qwen3-moe · build unknown · layout unknown" in out
    page = (tmp_path / "report" / "report.html").read_text()
    assert "run-1.png" in page and "pool_exhausted: 3 more free block(s) needed" in page
    png = (tmp_path / "report" / "run-1.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    rows = list(csv.DictReader((tmp_path / "report" / "report.csv").open()))
    # v1 rows have no min/max: they come from the timed steps
    assert [(r["total_kv_read_tokens"], r["batch_size"], r["median_ms"], r["min_ms"], r["max_ms"]) for r in rows][
        :2
    ] == [("1000", "4", "11.0000", "10.0000", "12.0000"), ("2000", "4", "21.0000", "20.0000", "22.0000")]

    fig = figure([load_run(source)])
    ax = fig.axes[0]
    assert ax.get_title(loc="left") == "Decode step time: tiny-qwen3-moe\nbuild unknown · layout unknown"
    # one series per batch size, and exactly the regimes present (no legacy here)
    assert legend(fig) == ["B=1", "B=4", REGIMES["real_kv"][0], REGIMES["fake_fallback"][0]]


def test_a_v2_artifact_names_model_build_and_layout_with_ticks_and_units(tmp_path):
    fig = figure([load_run(save(tmp_path / "v2", rank_artifact()))])
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.get_title(loc="left") == (
        "Decode step time: tiny-qwen3-moe\nbuild 9.9.1+kvwarm.3 · layout TP2 PP1 DP1 EP on"
    )
    assert legend(fig) == ["B=4", REGIMES["real_kv"][0]]
    assert "(tokens)" in ax.get_xlabel() and "(ms)" in ax.get_ylabel()
    for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
        shown = [t.get_text() for t in labels if t.get_text()]
        assert len(shown) >= 4, shown
    assert "2,000" in [t.get_text() for t in ax.get_xticklabels()]
    # the min-max bars of the steady_steps: one bar per point, from min to max
    bars = [c for c in ax.containers if c.has_yerr]
    segments = [seg for bar in bars for seg in bar.lines[2][0].get_segments()]
    assert sorted((round(s[0][1], 3), round(s[1][1], 3)) for s in segments) == [(9.8, 10.4), (19.6, 20.8)]


def test_a_schema_2_artifact_reads_as_today_s(tmp_path):
    today = load_run(save(tmp_path / "v3", rank_artifact()))
    old = load_run(save(tmp_path / "v2", as_schema_2(rank_artifact())))
    assert [(r.key, r.median_ms, r.regime) for r in old.rows] == [(r.key, r.median_ms, r.regime) for r in today.rows]
    assert old.describe() == today.describe() and old.meta.noisy_spread == NOISY_SPREAD
    assert [r.phases_ms for r in old.rows] == [{}, {}]


def test_a_combined_data_parallel_artifact_shows_its_ranks(tmp_path):
    from vllm.kvwarm.record.combined import combine

    ranks = [
        rank_artifact(medians_ms=(9.0, 18.0), data_parallel_size=2),
        rank_artifact(medians_ms=(10.0, 20.0), data_parallel_size=2),
    ]
    combined = combine(ranks)
    validate(combined)
    source = save(tmp_path / "dp", combined)
    save(tmp_path / "dp" / "dp0", ranks[0])
    assert run([source, "--out", str(tmp_path / "r")]) == 0
    page = (tmp_path / "r" / "report.html").read_text()
    assert "Data-parallel ranks" in page and "dp1/sweep.json" in page and "0: 9.000 1: 10.000" in page
    fig = figure([load_run(source)])
    assert "layout TP2 PP1 DP2 EP on" in fig.axes[0].get_title(loc="left")
    assert legend(fig) == ["B=4 per rank (8 over all ranks)", REGIMES["real_kv"][0]]


def test_the_legend_lists_only_the_regimes_drawn_and_noisy_rows(tmp_path):
    legacy = figure([from_artifact(rank_artifact(regime="legacy"), "off", "off")])
    assert legend(legacy) == ["B=4", REGIMES["legacy"][0]]
    noisy = figure([from_artifact(rank_artifact(reasons=["kvwarm_real_kv", "kvwarm_noisy"]), "n", "n")])
    assert legend(noisy) == ["B=4", REGIMES["real_kv"][0], "noisy (spread over 50%)"]


def test_a_real_sweeps_noisy_row_names_the_threshold_in_the_report(tmp_path):
    """A sweep stepped on a real Scheduler under a jittering clock (every other engine step
    takes 3 s, the others 1 s): the sweep stamps the row noisy, its writer records the
    threshold, and the report's legend names that figure."""
    from kvwarm_testing.real_kv import make_scheduler, step_scheduler
    from vllm.kvwarm.scheduler import KvWarmScheduler
    from vllm.kvwarm.sweep.controller import Sweep
    from vllm.kvwarm.sweep.plan import SweepConfig
    from vllm.kvwarm.sweep.points import DecodePoint
    from vllm.kvwarm.sweep.writer import ArtifactWriter
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    now = [0.0]
    scheduler = make_scheduler(tmp_path, num_blocks=64, scheduler_cls=KvWarmScheduler)
    sweep = Sweep(
        [DecodePoint(120, 2)],
        lambda i, depth: [(5 * i + t) % 200 + 2 for t in range(depth)],
        SweepConfig(steady_steps=3, max_model_len=1024),
        clock=lambda: now[0],
        progress=lambda _: None,
    )
    scheduler.kvwarm_sweep = sweep
    for step in range(200):
        if sweep.done:
            break
        now[0] += 3.0 if step % 2 else 1.0
        step_scheduler(scheduler)
    (row,) = sweep.rows
    assert "kvwarm_noisy" in row.sample_reasons and row.spread > NOISY_SPREAD
    writer = ArtifactWriter(str(tmp_path / "out"), {"model": "/m/tiny"})
    writer.rows = sweep.rows
    writer.write("complete")
    run_ = load_run(str(tmp_path / "out"))
    assert run_.meta.noisy_spread == NOISY_SPREAD
    assert legend(figure([run_]))[-1] == f"noisy (spread over {100 * NOISY_SPREAD:g}%)"


def test_plot_png_gives_the_png_of_an_artifact(monkeypatch):
    png = plot_png(rank_artifact())
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed
    assert plot_png(rank_artifact()) is None


def test_without_matplotlib_the_command_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert run([save(tmp_path / "a", rank_artifact())]) == 2
    assert capsys.readouterr().err.count("pip install matplotlib") == 1


def test_a_failed_artifact_renders_what_it_measured_marked_failed(tmp_path, capsys):
    source = save(tmp_path / "failed", rank_artifact(status="failed"))
    assert run([source, "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert f"{source}/sweep.json: the sweep failed (rank 0: RuntimeError: pool exhausted)" in err
    assert "rendering the 2 row(s) it measured, marked failed" in err
    assert "FAILED: rank 0: RuntimeError: pool exhausted" in (tmp_path / "r" / "report.html").read_text()
    assert "[FAILED]" in figure([load_run(source)]).axes[0].get_title(loc="left")


def test_a_v1_artifact_that_failed_before_measuring_still_renders(tmp_path):
    """As the sweep command writes it when the input is wrong: no rows, argv for the engine."""
    failed = v1_artifact(status="failed", error="points file /bench/points.json not found")
    failed.update(
        results=[],
        skipped_points=[],
        config={"points": "/bench/points.json", "engine_args": ["--model", "/models/tiny-llama/"]},
    )
    source = save(tmp_path / "failed", failed)
    assert run([source, "--out", str(tmp_path / "r")]) == 0
    fig = figure([load_run(source)])
    assert fig.axes[0].get_title(loc="left").startswith("Decode step time: tiny-llama  [FAILED]")
    assert fig.axes[0].get_legend() is None
    assert [t.get_text() for t in fig.axes[0].texts] == ["no point measured"]


def test_a_running_artifact_is_refused_unless_allowed(tmp_path, capsys):
    source = save(tmp_path / "running", rank_artifact(status="running"))
    assert run([source, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "status 'running'" in err and "--allow-running" in err and not (tmp_path / "r").exists()
    assert run([source, "--allow-running", "--out", str(tmp_path / "r")]) == 0
    assert "RUNNING" in (tmp_path / "r" / "report.html").read_text()


def _not_an_artifact():
    data = rank_artifact()
    del data["results"][0]["steady_seconds"]
    return data


@pytest.mark.parametrize(
    "make, message",
    [
        (None, "not found; pass a sweep's --out folder or its sweep.json"),
        (lambda d: d.mkdir(), "no sweep.json in this folder"),
        (lambda d: save(d / "dp0", rank_artifact()), "holds per-rank artifacts (dp0) but no combined sweep.json"),
        (lambda d: save(d, '{"schema_version": 2, "status": "compl'), "not valid JSON"),
        (lambda d: save(d, "[1, 2]"), "not a sweep artifact (a JSON list, not an object)"),
        (lambda d: save(d, {"results": []}), "not a sweep artifact (no integer schema_version)"),
        (lambda d: save(d, {"schema_version": 2, "status": "complete"}), "'results' is not a list"),
        (lambda d: save(d, _not_an_artifact()), "results[0]: not a measured row"),
        (
            lambda d: save(d, {**rank_artifact(), "schema_version": 4}),
            "schema_version 4; this report reads versions up to 3",
        ),
        (
            lambda d: save(d, {**rank_artifact(), "status": "done"}),
            "status 'done' is none of complete, failed, running",
        ),
    ],
)
def test_bad_input_is_named_with_its_problem_and_nothing_is_written(tmp_path, capsys, make, message):
    bad = tmp_path / "bad"
    if make:
        make(bad)
    good = save(tmp_path / "good", rank_artifact())
    assert run([good, str(bad), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert message in err and str(bad) in err
    assert not (tmp_path / "r").exists()


def test_every_bad_input_is_named_at_once(tmp_path, capsys):
    assert run([str(tmp_path / "one"), str(tmp_path / "two")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'one'}: not found" in err and f"{tmp_path / 'two'}: not found" in err


def test_the_sweeps_own_artifact_renders(tmp_path):
    """Whatever schema version the writer makes today, the report reads it."""
    from vllm.kvwarm.record.artifact import write_artifact

    rows = [PointRow(1000, 4, "real_kv", ["kvwarm_real_kv"], [0.010, 0.012, 0.011], 0.011)]
    write_artifact(tmp_path / "sweep", build_artifact(rows, KvwarmMeta(), {"model": "/m/tiny"}, "complete"))
    assert run([str(tmp_path / "sweep"), "--out", str(tmp_path / "r")]) == 0
    assert [r.median_ms for r in load_run(str(tmp_path / "sweep")).rows] == [pytest.approx(11.0)]


def test_prefill_rows_are_drawn_against_new_tokens_beside_decode_with_capture_sizes_marked(tmp_path, capsys):
    def prefill(n, p, b, ms):
        steps = [ms * 0.99 / 1e3, ms / 1e3, ms * 1.02 / 1e3]
        regime = "real_prefix" if p else "not_applicable"
        return PointRow(
            p,
            b,
            regime,
            ["prefill_real_seed"] if p else [],
            steps,
            ms / 1e3,
            point_type="prefill",
            total_prefill_tokens=n,
        )

    rows = [prefill(n, p, 2, 1.0 + n / 100 + p / 1000) for n in (64, 65, 128) for p in (0, 1024)]
    meta = KvwarmMeta(
        enabled=True,
        warm_eligible=True,
        giant_kv_repeats=3,
        noisy_spread=NOISY_SPREAD,
        cudagraph={
            "mode": "FULL_AND_PIECEWISE",
            "decode_mode": "FULL",
            "prefill_mode": "PIECEWISE",
            "capture_sizes": [32, 64, 512],
            "decode_capture_sizes": [32, 64],
            "prefill_capture_sizes": [32, 64, 512],
        },
    )
    decode = [PointRow(1000, 4, "real_kv", ["kvwarm_real_kv"], [0.01, 0.011, 0.012], 0.011)]
    artifact = build_artifact(
        decode + rows, meta, {"model": "/models/tiny-moe"}, "complete", run=RUN, layout=dict(LAYOUT)
    )
    validate(artifact)
    fig = figure([from_artifact(artifact, "both", "both")])
    decode_ax, prefill_ax = fig.axes
    assert decode_ax.get_title(loc="left").startswith("Prefill and decode step time: tiny-moe")
    assert [t.get_text() for t in prefill_ax.get_legend().get_texts()] == [
        "B=2, prefix 0",
        "B=2, prefix 512",
        REGIMES["real_prefix"][0],
        REGIMES["not_applicable"][0],
    ]
    assert "N: new tokens" in prefill_ax.get_xlabel()
    marked = sorted(line.get_xdata()[0] for line in prefill_ax.get_lines() if line.get_linestyle() == ":")
    assert marked == [32, 64]  # the capture sizes within the drawn tokens, not 512
    # the comparison joins prefill rows by (N, P, B) too
    other = build_artifact(
        decode + [prefill(64, 1024, 2, 2.0)], meta, {"model": "/m"}, "complete", run=RUN, layout=dict(LAYOUT)
    )
    a, b = save(tmp_path / "a", artifact), save(tmp_path / "b", other)
    assert run([a, b, "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "     1024    2        2.664        2.000   0.751  real_prefix / real_prefix (prefill N=64)" in out
    assert "unmatched: K=0 B=2 (prefill N=65) only in A (not in its points)" in out
