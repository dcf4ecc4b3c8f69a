"""`validate` on hand-written lines of the trace's current format (version 2: the raw numbers
the recorder writes, composed by the reader): speculative tokens, a preempted request
resuming, a request first seen mid-prompt; pauses read from the recorded gap under the batch
queue (where a window less its span never shows one); and the steps whose window holds the
sweep's work between its points, left out by their named reason and counted; the figures by
the graph each step ran in, beside the one its shape expects. Every figure is worked out by
hand on the rows of test_validate."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest
from kvwarm_testing.traces import header, raw_step, write_table, write_trace
from test_validate import DECODE_ROWS, PREFILL_ROWS, phases
from vllm.kvwarm.record.artifact import PointRow
from vllm.kvwarm.record.shape import GraphConfig, expected_graph
from vllm.kvwarm.record.trace.reader import read_trace
from vllm.kvwarm.record.validate.command import run
from vllm.kvwarm.record.validate.output import steps_csv, text
from vllm.kvwarm.record.validate.validation import validate

V2 = {"schema_version": 2}
TWO_DECODES = [(100, 1, 40), (100, 1, 40)]  # two requests past their 40-token prompts: 2 x 100, K 200


def continuation_row(n: int, p: int, forward_ms: float) -> PointRow:
    """A continuation prefill row of one request (its step: the forward and 1 ms of schedule)."""
    return PointRow(
        p,
        1,
        "real_prefix",
        [],
        [forward_ms / 1e3],
        forward_ms / 1e3,
        point_type="prefill",
        total_prefill_tokens=n,
        phases=phases(forward_ms),
        sample_kind="shot_forward",
        continuation=True,
    )


def test_raw_lines_are_composed_and_predicted_as_worked_out_by_hand(tmp_path):
    # Rows (a step: forward + 1 ms): at B = 1, N = 200 the new-request rows give 8 ms on no
    # prefix and 11 on 1000 (halfway along N), so 8.3 on a prefix of 100 and 8.192 on 64; the
    # continuation row (N 200, P 100) gives 21.
    steps = [
        raw_step(0, None, new=[[300, 0, 256]]),  # no window: left out, untimed
        # first seen mid-prompt (its first chunk not in the trace): the sink's guess of its
        # prompt is what it computed and scheduled; a later chunk: a continuation -> 21
        raw_step(1, 21.0, cached=[(100, 200, 300)]),
        # a preempted request resuming on a prefix hit of 100: a chunk, not a continuation -> 8.3
        raw_step(2, 8.3, cached=[(100, 200, 300)], resumed=[0]),
        # 3 scheduled of which 2 speculative: still a decode; the step is left out, speculative
        raw_step(3, 12.0, cached=[(150, 3, 100), (50, 1, 40)], spec=[2, 0]),
        # a request preempted out of the step: two decodes at K 200 -> 12 ms; the queue it left
        raw_step(4, 12.0, cached=TWO_DECODES, preempted=1, queued=[2, 500, 130_000, 1, 300, 90_000]),
        # a new chunk of 200 on a prefix hit of 64 beside the two decodes: composed, the prefill
        # part (8.192) plus the decodes' marginal over the least-work row (12 - 10) -> 10.192
        raw_step(5, 10.192, new=[[500, 64, 200]], cached=TWO_DECODES),
    ]
    write_trace(tmp_path / "trace", steps, head=header(**V2))
    composed = read_trace(tmp_path / "trace").steps
    spec, preempted = composed[3], composed[4]
    assert (spec.kind, spec.decode_requests, spec.decode_kv_tokens, spec.spec_tokens, spec.tokens) == (
        "decode",
        2,
        200,
        2,
        4,
    )
    assert (preempted.preempted, preempted.queued["var"], preempted.queued["resuming_kv_tokens"]) == (1, 2500.0, 300)
    assert [(s.continuations, s.prefill_prefix_tokens) for s in composed[1:3]] == [(1, 100), (0, 100)]
    table = write_table(tmp_path / "table", DECODE_ROWS + PREFILL_ROWS + [continuation_row(200, 100, 20.0)])
    result = validate(str(table), str(tmp_path / "trace"))
    assert result.excluded == {"untimed": 1, "speculative": 1}
    assert [(s.step.number, s.step.kind) for s in result.scored] == [
        (1, "prefill"),
        (2, "prefill"),
        (4, "decode"),
        (5, "mixed"),
    ]
    assert [s.prediction.ms for s in result.scored] == [
        pytest.approx(21.0),
        pytest.approx(8.3),
        pytest.approx(12.0),
        pytest.approx(10.192),
    ]
    assert all(s.error == pytest.approx(0.0, abs=1e-9) for s in result.scored)


def batch_queue_steps(gaps: bool) -> list[dict]:
    """Two decodes (K 200: predicted 12 ms) under the batch queue, each span 8 ms longer than
    its window (it began at its schedule(), before the last update ended). 18 ms passed
    between an update and step 13's schedule(), seen only in its gap; after it, and after the
    first step, the steps ran slower."""
    walls = {n: 15.0 for n in range(1, 10)} | {10: 12.0, 11: 12.0, 12: 12.0, 13: 30.0, 14: 15.0}
    steps = [raw_step(0, None, cached=TWO_DECODES, span_ms=13.0)]
    for n, wall in walls.items():
        gap = (18.0 if n == 13 else 0.2) if gaps else None
        steps.append(raw_step(n, wall, cached=TWO_DECODES, span_ms=wall + 8.0, gap_ms=gap))
    return steps


def test_under_the_batch_queue_pauses_are_read_from_the_recorded_gap(tmp_path):
    table = write_table(tmp_path / "table", DECODE_ROWS, resolved={"async_scheduling": True})
    head = header(loop="batch_queue", **V2)
    write_trace(tmp_path / "gaps", batch_queue_steps(gaps=True), head=head)
    result = validate(str(table), str(tmp_path / "gaps"))
    assert result.pause_rules == {0: "gap"}
    # pauses before steps 0 and 13: steps 1-9 (15 ms: -20 %), 13 (30: -60 %) and 14 (-20 %)
    # within 10 steps of one; 10-12 (12 ms: 0) not
    pauses = result.kinds()["decode"]["pauses"]
    assert pauses["share"] == pytest.approx(100 * 11 / 14)
    assert pauses["after_pause"]["mape"] == pytest.approx((10 * 20 + 60) / 11)
    assert (pauses["others"]["steps"], pauses["others"]["mape"]) == (3, pytest.approx(0.0))
    summary = result.summary()
    assert summary["pause_rule"] == "gap" and summary["decode_steady_mape"] == pytest.approx(0.0)
    assert "pauses on rank 0 read by gap: the recorded gap from an update's end to the next schedule()" in text(result)
    # the same steps without the field: only the step without a window is seen, and said so
    write_trace(tmp_path / "no-gaps", batch_queue_steps(gaps=False), head=head)
    blind = validate(str(table), str(tmp_path / "no-gaps"))
    assert blind.pause_rules == {0: "no_window_only"}
    assert blind.kinds()["decode"]["pauses"]["share"] == pytest.approx(100 * 9 / 14)
    assert "read by no_window_only: only the steps without a window" in text(blind)


def test_a_sync_trace_without_gaps_keeps_the_window_less_span_rule(tmp_path):
    # one step at a time: step 2's window holds 18 ms more than its span, a pause
    steps = [raw_step(0, None, cached=TWO_DECODES)]
    steps += [raw_step(n, 12.0 + 18 * (n == 2), cached=TWO_DECODES, span_ms=11.9) for n in (1, 2, 3)]
    write_trace(tmp_path / "trace", steps, head=header(**V2))
    result = validate(str(write_table(tmp_path / "table", DECODE_ROWS)), str(tmp_path / "trace"))
    assert result.pause_rules == {0: "wall_minus_span"}
    assert [s.since_pause for s in result.scored] == [1, 0, 1]


def test_steps_carrying_the_sweeps_work_are_left_out_by_name_and_counted(tmp_path, capsys):
    steps = [
        raw_step(0, None, cached=TWO_DECODES),
        raw_step(1, 12.0, cached=TWO_DECODES, gap_ms=0.1),
        raw_step(2, None, cached=TWO_DECODES, gap_ms=0.1, untimed="sweep_between_points"),
        raw_step(3, 12.0, cached=TWO_DECODES, gap_ms=0.1),
    ]
    write_trace(tmp_path / "trace", steps, head=header(**V2))
    table = str(write_table(tmp_path / "table", DECODE_ROWS))
    result = validate(table, str(tmp_path / "trace"))
    assert result.excluded == {"untimed": 1, "sweep_between_points": 1}
    assert [s.step.number for s in result.scored] == [1, 3]
    assert result.scored[1].since_pause == 1  # the sweep's work between points paused the engine
    assert "left out: 1 sweep_between_points step(s) (their window holds the sweep's own work" in text(result)
    left = {r["step"]: r["left_out"] for r in csv.DictReader(steps_csv(result).splitlines())}
    assert left == {"1": "", "3": "", "0": "untimed", "2": "sweep_between_points"}
    out = tmp_path / "out"
    assert run([table, str(tmp_path / "trace"), "--out", str(out), "--json"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["excluded"] == 2 and line["excluded_by_reason"] == {"untimed": 1, "sweep_between_points": 1}


def test_the_figures_split_by_the_graph_each_step_ran_and_its_expected_one(tmp_path):
    # the engine: full graphs for decode batches of 1-8, piecewise ones for other steps; two
    # decodes expect the full graph of 2. Steps 1-2 ran it (12 ms, as the rows); steps 3-4 ran
    # eager (24 ms: -50 %), step 5 said nothing of its graph
    graphs = {"enforce_eager": False, "cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8]}
    said = {1: ["FULL", 2], 2: ["FULL", 2], 3: ["NONE", 2], 4: ["NONE", 2], 5: None}
    steps = [raw_step(0, None, cached=TWO_DECODES)]
    steps += [raw_step(n, 24.0 if n in (3, 4) else 12.0, cached=TWO_DECODES, graph=g) for n, g in said.items()]
    write_trace(tmp_path / "trace", steps, head=header(resolved=graphs, **V2))
    # the table's rows: two whose graph the runner reported (one ran another than expected),
    # two whose runner reported none
    expected = expected_graph(GraphConfig.of("FULL_AND_PIECEWISE", "FULL", "PIECEWISE", [1, 2, 4, 8], 8, 256), 2, 2)
    rows = [dataclasses.replace(r, graph=dict(expected)) for r in DECODE_ROWS]
    rows[0].observed_graphs, rows[1].observed_graphs = [["FULL", 2]], [["PIECEWISE", 2]]
    rows[2].observed_why = rows[3].observed_why = "the model runner reported no cudagraph_stats"
    result = validate(str(write_table(tmp_path / "table", rows, resolved=graphs)), str(tmp_path / "trace"))
    decode = result.kinds()["decode"]
    by_mode = {mode: (f["steps"], f["mape"], f["bias"]) for mode, f in decode["graphs"].items()}
    assert by_mode == {
        "FULL": (2, pytest.approx(0.0), pytest.approx(0.0)),
        "NONE": (2, pytest.approx(50.0), pytest.approx(-50.0)),
        "unreported": (1, pytest.approx(0.0), pytest.approx(0.0)),
    }
    assert decode["expected_against_observed"] == [
        {"expected": "FULL", "observed": "NONE", "steps": 2, "mape": pytest.approx(50.0), "bias": pytest.approx(-50.0)},
        {"expected": "FULL", "observed": "FULL", "steps": 2, "mape": pytest.approx(0.0), "bias": pytest.approx(0.0)},
    ]
    summary = result.summary()
    assert (summary["graph_reported_steps"], summary["graph_unexpected_steps"]) == (4, 2)
    printed = text(result)
    assert "decode: 2 step(s) ran graph NONE where their shape expects FULL: MAPE 50.00%, bias -50.00%" in printed
    assert "table: 1 of the 2 row(s) whose graph the runner reported ran the graph their shape expects" in printed
    assert "table: 2 row(s) without an observed graph: the model runner reported no cudagraph_stats" in printed
    lines = list(csv.DictReader(steps_csv(result).splitlines()))
    assert [(r["graph_mode"], r["padded_tokens"], r["expected_graph_mode"]) for r in lines[:5]] == [
        ("FULL", "2", "FULL"),
        ("FULL", "2", "FULL"),
        ("NONE", "2", "FULL"),
        ("NONE", "2", "FULL"),
        ("", "", "FULL"),
    ]
