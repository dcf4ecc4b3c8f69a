"""`python -m vllm.kvwarm validate TABLE TRACE`: the predictor against figures worked out by
hand on small made tables, the trace reader, the figures per kind and band, the refusals and
the command line. Tables are written by the sweep's own artifact writer, traces as the
recorder's JSON lines (kvwarm_testing.traces); nothing here starts an engine."""

from __future__ import annotations

import csv
import json

import pytest
from kvwarm_testing.traces import HARDWARE, header, step, write_table, write_trace
from vllm.kvwarm.record.artifact import PointRow
from vllm.kvwarm.record.combined import write_view
from vllm.kvwarm.record.runs import from_artifact
from vllm.kvwarm.record.trace.reader import TraceError, read_trace
from vllm.kvwarm.record.validate.command import run
from vllm.kvwarm.record.validate.metrics import band
from vllm.kvwarm.record.validate.output import text
from vllm.kvwarm.record.validate.predict import FORWARD, MixedRow, Predictor, read_mixed_rows
from vllm.kvwarm.record.validate.validation import ValidateError, validate


def phases(forward_ms: float, host_ms: float = 1.0) -> dict:
    """A row's phase medians (seconds): the forward and `host_ms` of schedule()."""
    return {"schedule": host_ms / 1e3, "forward": forward_ms / 1e3, "update": 0.0, "sweep": 0.0, "other": 0.0}


def decode(k: int, b: int, ms: float, forward_ms: float | None = None) -> PointRow:
    return PointRow(k, b, "real_kv", [], [ms / 1e3], ms / 1e3, phases=phases(forward_ms or ms - 2))


def prefill(n: int, p: int, b: int, forward_ms: float) -> PointRow:
    """A prefill row: its samples time the forward; its whole step is 1 ms more (schedule)."""
    regime = "real_prefix" if p else "not_applicable"
    return PointRow(
        p,
        b,
        regime,
        [],
        [forward_ms / 1e3],
        forward_ms / 1e3,
        point_type="prefill",
        total_prefill_tokens=n,
        phases=phases(forward_ms),
        sample_kind="shot_forward",
    )


# decode: B = 2 at K 100 / 300 -> 10 / 14 ms (8 + K / 50); B = 4 at K 200 / 600 -> 14 / 30 ms
# (6 + K / 25): curves of different slopes, so that reading them at equal context per request
# and at equal K give different answers
DECODE_ROWS = [decode(100, 2, 10), decode(300, 2, 14), decode(200, 4, 14), decode(600, 4, 30)]
# prefill at B = 1 (forward ms): P = 0: N 100 / 300 -> 5 / 9; P = 1000: N 100 / 300 -> 7 / 13;
# at B = 3: P = 0, N 300 / 900 -> 6 / 12
PREFILL_ROWS = [
    prefill(100, 0, 1, 5),
    prefill(300, 0, 1, 9),
    prefill(100, 1000, 1, 7),
    prefill(300, 1000, 1, 13),
    prefill(300, 0, 3, 6),
    prefill(900, 0, 3, 12),
]


def predictor(rows, mixed=(), basis="step") -> Predictor:
    from vllm.kvwarm.record.artifact import KvwarmMeta, build_artifact

    artifact = build_artifact(rows, KvwarmMeta(), {"points": "p.json"}, "complete")
    return Predictor(from_artifact(artifact, "t", "t").rows, list(mixed), basis)


def test_decode_is_piecewise_linear_in_k_and_linear_in_b_at_equal_context_per_request():
    p = predictor(DECODE_ROWS)
    assert p.decode_step(2, 100).ms == pytest.approx(10.0) and p.decode_step(2, 100).inside
    assert p.decode_step(2, 200).ms == pytest.approx(12.0)  # halfway along B = 2's curve
    # B = 3 at K = 300 (100 per request): B = 2 read at K 200 (12), B = 4 at K 400 (22)
    mid = p.decode_step(3, 300)
    assert (mid.ms, mid.inside, mid.how) == (pytest.approx(17.0), True, "measured")
    # beyond B = 2's deepest row: its last segment extended, outside the table
    deep = p.decode_step(2, 400)
    assert (deep.ms, deep.inside) == (pytest.approx(16.0), False)
    # beyond the widest batch: the line through B = 2 and B = 4 at 100 per request (12, 22)
    wide = p.decode_step(6, 600)
    assert (wide.ms, wide.inside) == (pytest.approx(32.0), False)


def test_prefill_is_the_same_over_n_and_p_on_the_whole_step_or_the_forward():
    p = predictor(PREFILL_ROWS)
    # B = 1, N 200, P 500: P = 0's curve gives 7 + 1, P = 1000's 10 + 1; halfway: 9.5
    assert p.prefill_step(1, 200, 500).ms == pytest.approx(9.5) and p.prefill_step(1, 200, 500).inside
    # B = 2, N 400, P 0 (200 new tokens per request): B = 1 at N 200 gives 7 + 1, B = 3 at
    # N 600 gives 9 + 1; halfway: 9
    between = p.prefill_step(2, 400, 0)
    assert (between.ms, between.inside) == (pytest.approx(9.0), True)
    # B = 1 has prefixes, B = 3 none: a prefix at B = 2 is beyond B = 3's rows (outside)
    assert not p.prefill_step(2, 400, 1000).inside
    forward = predictor(PREFILL_ROWS, basis=FORWARD)
    assert forward.prefill_step(1, 200, 500).ms == pytest.approx(8.5)


def test_a_mixed_step_is_composed_from_prefill_and_the_decode_marginal_without_mixed_rows():
    p = predictor(DECODE_ROWS + PREFILL_ROWS)
    # prefill (1, 200, 500) = 9.5; decode (2, 200) = 12 over the baseline (B = 2, K = 100) 10
    mixed = p.mixed_step(2, 200, 1, 200, 500)
    assert (mixed.ms, mixed.inside, mixed.how) == (pytest.approx(11.5), True, "composed")
    assert p.kinds() == {"decode": "measured", "prefill": "measured", "mixed": "composed"}
    assert predictor(DECODE_ROWS).kinds()["mixed"] is None  # nothing to compose from


def test_measured_mixed_rows_are_read_and_preferred_to_the_composition():
    rows = [
        MixedRow(2, 100, 1, 100, 0, 20.0, {}),
        MixedRow(2, 300, 1, 100, 0, 24.0, {}),
        MixedRow(2, 100, 1, 300, 0, 30.0, {}),
        MixedRow(2, 300, 1, 300, 0, 34.0, {}),
    ]
    p = predictor(DECODE_ROWS + PREFILL_ROWS, rows)
    # at N 100: 22 (halfway in K), at N 300: 32; halfway in N: 27
    mixed = p.mixed_step(2, 200, 1, 200, 0)
    assert (mixed.ms, mixed.inside, mixed.how) == (pytest.approx(27.0), True, "measured")
    artifact = {
        "results": [
            {
                "point": {
                    "point_type": "mixed",
                    "decode": {"batch_size": 2, "total_kv_read_tokens": 100},
                    "prefill": {"batch_size": 1, "total_prefill_tokens": 300, "total_kv_read_tokens": 0},
                },
                "median_seconds": 0.03,
                "phases": {"forward": 0.025},
            }
        ]
    }
    assert read_mixed_rows(artifact) == [MixedRow(2, 100, 1, 300, 0, 30.0, {"forward": 25.0})]


def test_mixed_rows_on_the_token_budget_enclose_the_steps_between_their_decode_batches():
    """Chunked prefill fills the budget (512 here): a step of d decodes holds a chunk of
    512 - d. Rows at d = 1 and 7 on that line, at two contexts each, enclose a step of 4
    decodes and a 508-token chunk: the surface's node is the step's 512 tokens, not the N
    that differs for each decode batch."""
    rows = [MixedRow(b, k, 1, 512 - b, 0, ms, {}) for b, k, ms in ((1, 100, 10.0), (1, 900, 12.0))]
    rows += [MixedRow(b, k, 1, 512 - b, 0, ms, {}) for b, k, ms in ((7, 700, 16.0), (7, 6300, 22.0))]
    p = predictor(DECODE_ROWS + PREFILL_ROWS, rows)
    # K per request 100 on both curves: B = 1 at K 100: 10, B = 7 at K 700: 16; B = 4 halfway: 13
    mixed = p.mixed_step(4, 400, 1, 508, 0)
    assert (mixed.ms, mixed.inside, mixed.how) == (pytest.approx(13.0), True, "measured")
    # A last chunk short of the budget lies below the rows' tokens: extrapolated, not inside.
    assert not p.mixed_step(4, 400, 1, 300, 0).inside


def test_a_mixed_step_between_prefill_batch_sizes_is_read_at_its_own_step_tokens():
    """Two chunks sharing the budget (512) beside 2 decodes: rows at one and three prefill
    requests on that budget enclose it. At equal tokens per request (as prefill rows are
    read) it would sit at 765 tokens on the three-request rows, past the budget."""
    rows = [MixedRow(2, 200, pb, 510, pb * 160, ms, {}) for pb, ms in ((1, 10.0), (3, 14.0))]
    rows += [MixedRow(4, 400, pb, 508, pb * 160, ms, {}) for pb, ms in ((1, 12.0), (3, 18.0))]
    rows += [MixedRow(2, 200, pb, 254, pb * 160, ms, {}) for pb, ms in ((1, 6.0), (3, 8.0))]
    rows += [MixedRow(4, 400, pb, 252, pb * 160, ms, {}) for pb, ms in ((1, 7.0), (3, 9.0))]
    p = predictor(DECODE_ROWS + PREFILL_ROWS, rows)
    mixed = p.mixed_step(2, 200, 2, 510, 320)  # halfway between 10 and 14
    assert (mixed.ms, mixed.inside, mixed.how) == (pytest.approx(12.0), True, "measured")


def test_the_reader_takes_rotated_files_oldest_first_and_reports_a_torn_last_line(tmp_path):
    trace = tmp_path / "trace"
    write_trace(trace, [step(0, None, (1, 10)), step(1, 5, (1, 11))], rotation=2)
    write_trace(trace, [step(2, 5, (1, 12))], rotation=1)
    write_trace(trace, [step(3, 5, (1, 13))], tail='{"step": 4, "wall": 0.0')
    read = read_trace(trace)
    assert [s.number for s in read.steps] == [0, 1, 2, 3]
    assert read.torn == [f"{trace / 'trace-dp0.jsonl'}: line 3"]
    (trace / "trace-dp0.1.jsonl").write_text(json.dumps(header()) + "\n{torn\n" + json.dumps(step(2, 5)) + "\n")
    with pytest.raises(TraceError, match=r"trace-dp0\.1\.jsonl: line 2 is not JSON, and is not the file's last"):
        read_trace(trace)


@pytest.mark.parametrize(
    "head, message",
    [
        (header(schema_version=4), "trace schema_version 4; this reader reads 1, 2, 3"),
        (header(type="kvwarm_sweep"), "not a kvwarm trace header"),
        (header(rank=1), "header says rank 1, the file's name rank 0"),
        (header(timing={"basis": "schedule_to_output"}), "timing basis 'schedule_to_output'"),
    ],
)
def test_a_header_that_is_not_a_trace_of_this_version_is_refused_by_name(tmp_path, head, message):
    write_trace(tmp_path, [step(0, 5, (1, 10))], head=head)
    with pytest.raises(TraceError, match=message):
        read_trace(tmp_path)


def test_an_empty_trace_or_a_folder_without_one_is_refused(tmp_path):
    with pytest.raises(TraceError, match="no trace-dp<R>.jsonl here"):
        read_trace(tmp_path)
    write_trace(tmp_path, [], tail='{"step": 0, "wa')
    with pytest.raises(TraceError, match="an empty trace: headers but no step recorded .only a torn line"):
        read_trace(tmp_path)
    write_trace(tmp_path / "other", [step(0, 5, (1, 10))], head=header(started_at="2026-12-02T00:00:00Z"), rotation=1)
    write_trace(tmp_path / "other", [step(1, 5, (1, 10))])
    with pytest.raises(TraceError, match="keep one run's files in a trace folder"):
        read_trace(tmp_path / "other")


def served_trace(folder):
    """Decode steps of known error, three repeats of one shape, a prefill and a mixed step,
    a first step without a wall and a speculative one (both left out)."""
    steps = [
        step(0, None, (2, 200)),
        step(1, 12.0, (2, 200)),  # predicted 12: error 0
        step(2, 15.0, (3, 300)),  # predicted 17: +13.333 %
        step(3, 20.0, (4, 400)),  # predicted 22 (B = 4: 6 + K / 25 ms): +10 %
        step(4, 22.0, (4, 401)),  # the same shape (within 1 %): 22.04
        step(5, 24.0, (4, 402)),  # 22.08
        step(6, 10.0, (0, 0), (1, 200, 500)),  # prefill: predicted 9.5: -5 %
        step(7, 11.0, (2, 200), (1, 200, 500)),  # mixed, composed 11.5: +4.545 %
        step(8, 30.0, (2, 5000)),  # deep: outside the table
        step(9, 12.0, (2, 200), spec_tokens=2),
    ]
    write_trace(folder, steps)
    return folder


def test_the_figures_per_kind_and_band_match_those_worked_out_by_hand(tmp_path):
    table = write_table(tmp_path / "table", DECODE_ROWS + PREFILL_ROWS)
    result = validate(str(table), str(served_trace(tmp_path / "trace")))
    assert result.excluded == {"untimed": 1, "speculative": 1}
    decode = result.kinds()["decode"]
    # decode errors (%): 0, 2 / 15, 2 / 20, 0.04 / 22, -1.92 / 24, and the deep step 2 x 5000:
    # B = 2's last segment extended (0.02 ms per token: 108 ms) against 30
    deep = 100 * (10 + 4 * 4900 / 200 - 30) / 30
    errors = [0, 100 * 2 / 15, 100 * 2 / 20, 100 * 0.04 / 22, 100 * -1.92 / 24, deep]
    assert decode["steps"] == 6 and decode["covered"] == 5
    assert decode["mape"] == pytest.approx(sum(map(abs, errors)) / 6)
    assert decode["bias"] == pytest.approx(sum(errors) / 6)
    # the median signed error: the 3rd and 4th of the six sorted (-8, 0, 0.18, 10, 13.3, 260): the deep step's
    # +260 % moves the bias (+46 %), not the median
    assert decode["median_error"] == pytest.approx((100 * 0.04 / 22 + 100 * 2 / 20) / 2)
    # the repeat noise: steps 3-5 (20, 22, 24 ms around their median 22): 2/22, 0, 2/22
    assert decode["noise"] == pytest.approx(100 * 4 / 66) and decode["noise_steps"] == 3
    assert set(decode["bands"]) == {"0-1k", "4k-16k"} and decode["bands"]["4k-16k"]["coverage"] == 0
    assert result.kinds()["prefill"]["mape"] == pytest.approx(5.0)
    assert result.kinds()["mixed"]["bias"] == pytest.approx(100 * 0.5 / 11)
    assert result.kinds()["mixed"]["predictor"] == "composed"
    summary = result.summary()
    assert summary["steps"] == 8 and summary["coverage"] == pytest.approx(100 * 7 / 8)
    assert summary["noise"] == summary["decode_noise"]


def test_band_edges_are_powers_of_four_from_1k():
    assert [band(d) for d in (0, 1023, 1024, 4096, 65535, 1 << 20, 10 << 20)] == [
        "0-1k",
        "0-1k",
        "1k-4k",
        "4k-16k",
        "16k-64k",
        "1M+",
        "1M+",
    ]


def test_a_kind_the_table_has_no_rows_for_is_reported_not_covered(tmp_path):
    table = write_table(tmp_path / "table", DECODE_ROWS)
    result = validate(str(table), str(served_trace(tmp_path / "trace")))
    kinds = result.kinds()
    assert kinds["prefill"]["not_covered"] == "the table has no prefill rows" and kinds["prefill"]["mape"] is None
    assert "neither mixed rows nor both" in kinds["mixed"]["not_covered"]
    assert kinds["decode"]["not_covered"] is None and result.summary()["prefill_mape"] is None


@pytest.mark.parametrize(
    "table_changes, named",
    [
        ({"model": "/models/tiny-llama"}, "model (trace 'tiny-qwen3-moe', table 'tiny-llama')"),
        ({"resolved": {"dtype": "bfloat16"}}, "resolved.dtype (trace 'float32', table 'bfloat16')"),
        ({"resolved": {"max_num_batched_tokens": 512}}, "resolved.max_num_batched_tokens"),
        ({"resolved": {"cudagraph_capture_sizes": [1, 2, 4]}}, "resolved.cudagraph_capture_sizes"),
        ({"build": {"version": "9.9.1+kvwarm.4"}}, "build.version"),
        ({"hardware": {"cpu": "Intel Xeon"}}, "hardware.cpu"),
        (
            {"resolved": {"distributed_executor_backend": "uni"}},
            (
                "resolved.distributed_executor_backend (trace 'mp', table 'uni'; "
                "the trace's: --distributed-executor-backend mp)"
            ),
        ),
    ],
)
def test_a_trace_and_a_table_that_differ_in_a_step_time_field_are_refused_naming_it(tmp_path, table_changes, named):
    from kvwarm_testing.traces import BUILD, HARDWARE

    fields = {}
    if "build" in table_changes:
        fields["build"] = {**BUILD, **table_changes["build"]}
    if "hardware" in table_changes:
        fields["hardware"] = {**HARDWARE, **table_changes["hardware"]}
    table = write_table(
        tmp_path / "table",
        DECODE_ROWS,
        resolved=table_changes.get("resolved"),
        model=table_changes.get("model", "/models/tiny-qwen3-moe"),
        **fields,
    )
    with pytest.raises(ValidateError, match="differ in what changes a step's time") as err:
        validate(str(table), str(served_trace(tmp_path / "trace")))
    assert named in str(err.value) and "--grid-from" in str(err.value)


def test_fields_that_do_not_change_a_step_are_noted_not_refused(tmp_path):
    table = write_table(tmp_path / "table", DECODE_ROWS, resolved={"max_num_seqs": 64, "num_gpu_blocks": 10})
    result = validate(str(table), str(served_trace(tmp_path / "trace")))
    assert {d.field for d in result.match.noted} == {"resolved.max_num_seqs", "resolved.num_gpu_blocks"}


def test_a_table_swept_under_other_huge_pages_than_the_trace_is_noted(tmp_path):
    trace = tmp_path / "trace"
    write_trace(
        trace,
        [step(0, None, (2, 200)), step(1, 12.0, (2, 200))],
        head=header(hardware={**HARDWARE, "transparent_hugepages": "madvise"}),
    )
    table = write_table(tmp_path / "table", DECODE_ROWS, hardware={**HARDWARE, "transparent_hugepages": "always"})
    result = validate(str(table), str(trace))
    assert [(d.field, d.trace, d.table) for d in result.match.noted] == [
        ("hardware.transparent_hugepages", "madvise", "always")
    ]
    assert "differs, said and not refused: hardware.transparent_hugepages" in text(result)


def test_an_async_trace_against_a_sync_table_is_refused_unless_allowed(tmp_path):
    table = write_table(tmp_path / "table", DECODE_ROWS)
    trace = tmp_path / "trace"
    write_trace(trace, [step(0, None, (2, 100)), step(1, 10, (2, 100))], head=header(loop="batch_queue"))
    with pytest.raises(ValidateError, match="the trace ran the batch_queue engine loop, the table the sync one") as err:
        validate(str(table), str(trace))
    assert "--allow-loop-mismatch" in str(err.value)
    result = validate(str(table), str(trace), allow_loop_mismatch=True)
    assert result.match.loop == ("batch_queue", "sync") and result.summary()["decode_mape"] == pytest.approx(0.0)


def test_each_rank_is_predicted_from_its_own_rows_of_a_data_parallel_table(tmp_path):
    from vllm.kvwarm.record.artifact import KvwarmMeta, build_artifact, write_artifact
    from vllm.kvwarm.record.combined import rank_path

    root = tmp_path / "table"
    artifacts = []
    for rank, scale in ((0, 1.0), (1, 2.0)):
        rows = [decode(100, 2, 10 * scale), decode(300, 2, 14 * scale)]
        layout = {
            "data_parallel_size": 2,
            "data_parallel_rank": rank,
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "expert_parallel": True,
        }
        artifact = build_artifact(rows, KvwarmMeta(), {"points": "p", "model": "/m/tiny"}, "complete", layout=layout)
        write_artifact(root / rank_path(rank).rsplit("/", 1)[0], artifact)
        artifacts.append(artifact)
    write_view(root, artifacts)
    trace = tmp_path / "trace"
    for rank in (0, 1):
        head = header(rank, 2, model="/m/tiny", build=None, hardware={}, torch=None, engine={"given": []})
        head["layout"]["expert_parallel"] = True
        write_trace(trace, [step(0, None, (2, 200)), step(1, 12 * (1 + rank), (2, 200))], head=head, rank=rank)
    result = validate(str(root), str(trace))
    assert [(s.step.rank, s.prediction.ms) for s in result.scored] == [(0, pytest.approx(12)), (1, pytest.approx(24))]
    with pytest.raises(ValidateError, match="one rank's artifact of a sweep on 2 data-parallel ranks"):
        validate(str(root / "dp1"), str(trace))


def test_the_command_prints_its_json_line_and_writes_json_csv_and_a_plot(tmp_path, capsys):
    table = write_table(tmp_path / "table", DECODE_ROWS + PREFILL_ROWS)
    trace = served_trace(tmp_path / "trace")
    out = tmp_path / "report"
    assert run([str(table), str(trace), "--out", str(out), "--json"]) == 0
    line = json.loads(capsys.readouterr().out.strip())
    contract = {"decode_mape", "decode_p95", "decode_bias", "prefill_mape", "mixed_mape", "noise", "coverage", "steps"}
    assert contract <= set(line) and line["steps"] == 8
    record = json.loads((out / "validate.json").read_text())
    assert record["summary"] == line and record["excluded"] == {"untimed": 1, "speculative": 1}
    lines = list(csv.DictReader((out / "validate.csv").open()))
    rows = [r for r in lines if not r["left_out"]]  # then the two left out, each with why
    assert len(rows) == 8 and {r["kind"] for r in rows} == {"decode", "prefill", "mixed"}
    left_out = [(r["step"], r["left_out"], r["served_ms"]) for r in lines[8:]]
    assert left_out == [("0", "untimed", ""), ("9", "speculative", "")]
    assert rows[0]["predicted_ms"] == "12.0000" and rows[0]["error_pct"] == "0.000"
    pytest.importorskip("matplotlib")
    assert (out / "validate.png").read_bytes().startswith(b"\x89PNG")


def test_the_command_prints_the_table_and_refuses_bad_input_with_exit_2(tmp_path, capsys):
    from vllm.kvwarm.__main__ import main

    table = write_table(tmp_path / "table", DECODE_ROWS + PREFILL_ROWS)
    trace = served_trace(tmp_path / "trace")
    assert main(["validate", str(table), str(trace), "--out", str(tmp_path / "r")]) == 0
    printed = capsys.readouterr().out
    assert "decode   0-1k" in printed and "mixed*   all" in printed and "left out: 1 speculative step(s)" in printed
    assert main(["validate", str(table), str(tmp_path / "nowhere"), "--out", str(tmp_path / "r2")]) == 2
    assert "not a folder; pass the folder the trace setting wrote" in capsys.readouterr().err
    assert not (tmp_path / "r2").exists()


def mixed(decode_k: int, forward_ms: float) -> PointRow:
    """A measured mixed row (its forward; its step 1 ms more): 2 decodes at `decode_k` beside
    one prefill of 200 new tokens on a prefix of 500 (the served trace's mixed step's prefill
    part)."""
    parts = {
        "decode": {"batch_size": 2, "total_kv_read_tokens": decode_k},
        "prefill": {"batch_size": 1, "total_prefill_tokens": 200, "total_kv_read_tokens": 500},
    }
    return PointRow(
        decode_k + 500,
        3,
        "real_kv",
        [],
        [forward_ms / 1e3],
        forward_ms / 1e3,
        point_type="mixed",
        total_prefill_tokens=200,
        phases=phases(forward_ms),
        parts=parts,
    )


def test_mixed_steps_from_measured_rows_are_also_composed_for_comparison(tmp_path):
    # the trace's mixed step (2 decodes at 200 beside 1 x 200 new on 500) ran 11 ms: the mixed
    # rows' steps (forward + 1 ms of schedule) at K 100 and 300, 10 and 12 ms, give 11.0 halfway
    # (error 0); the composition gives 11.5 (+4.545 %)
    rows = DECODE_ROWS + PREFILL_ROWS + [mixed(100, 9.0), mixed(300, 11.0)]
    table = write_table(tmp_path / "table", rows)
    result = validate(str(table), str(served_trace(tmp_path / "trace")))
    summary = result.summary()
    assert summary["mixed_predictor"] == "measured" and summary["mixed_mape"] == pytest.approx(0.0)
    assert summary["mixed_composed_mape"] == pytest.approx(100 * 0.5 / 11)
    assert summary["mixed_composed_bias"] == pytest.approx(100 * 0.5 / 11)
    # the mixed step is the 7th after the rank's first (a pause): split as decode steps are
    assert summary["mixed_after_pause_share"] == 100.0 and summary["mixed_steady_mape"] is None
    assert "mixed, composed as planners do" in text(result) and "MAPE 4.55%" in text(result)
    # without mixed rows there is nothing to compare: the composition is the prediction
    plain = validate(str(write_table(tmp_path / "plain", DECODE_ROWS + PREFILL_ROWS)), str(tmp_path / "trace"))
    assert plain.summary()["mixed_composed_mape"] is None and "composed as planners do" not in text(plain)
