"""`export TRACE --to fpm`: a served-step trace as Dynamo's forward-pass metrics capture. Hand-
written lines of the recorder's format give FPMs worked out by hand, every field; a trace
written by the real recorder (the real Scheduler stepped by kvwarm_testing.recorded) gives one
FPM per line, each held against its raw line and against the shape of the FPMs Dynamo 1.6.1
itself wrote (tests/fixtures/dynamo-1.6.1: the same keys with the same JSON types); Dynamo's own
struct reads them in tests/engine/test_export_consumers.py. Dynamo's FPM has no field for the
graph a step ran in, so the export carries none."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kvwarm_testing.recorded import current_files, made_trace, read, rotated_trace
from kvwarm_testing.traces import header, raw_step, write_trace
from vllm.kvwarm.record.export.command import run as export

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dynamo-1.6.1" / "benchmark_decode.json"


def _json_types(value) -> object:
    if isinstance(value, dict):
        return {k: _json_types(v) for k, v in value.items()}
    return type(value).__name__


def _captured(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


NO_QUEUE = {
    "num_prefill_requests": 0,
    "sum_prefill_tokens": 0,
    "var_prefill_length": 0.0,
    "num_decode_requests": 0,
    "sum_decode_kv_tokens": 0,
    "var_decode_kv_tokens": 0.0,
}
STARTED_NS = 1_796_119_200 * 10**9  # the headers' started_at, 2026-12-01T10:00:00Z, in Unix ns


def test_each_field_of_the_fpm_is_the_one_worked_out_by_hand(tmp_path, capsys):
    steps = [
        # a new request (prompt 300, 64 cached, 200 now) beside decodes at 100 and 50; two
        # prompts of 200 and 300 and a preempted request of 300 tokens wait; no window: its span
        raw_step(
            0,
            None,
            new=[[300, 64, 200]],
            cached=[(100, 1, 40), (50, 1, 30)],
            span_ms=4.0,
            queued=[2, 500, 200**2 + 300**2, 1, 300, 300**2],
        ),
        # two new prompts of 100 and 300, 100 and 150 of them now; its window
        raw_step(1, 12.0, new=[[100, 0, 100], [300, 0, 150]], span_ms=11.0),
        raw_step(2, None, cached=[(100, 1, 40)]),  # neither a window nor a span: left out
    ]
    write_trace(tmp_path / "trace", steps, head=header(schema_version=2))
    assert export([str(tmp_path / "trace"), "--to", "fpm"]) == 0
    assert "2 forward-pass metrics of 1 rank(s) (1 step(s) without a wall or a span left out)" in (
        capsys.readouterr().out
    )
    first = {
        "version": 1,
        "worker_id": "",
        "dp_rank": 0,
        "counter_id": 1,
        "wall_time": 0.004,
        "scheduled_requests": {
            "num_prefill_requests": 1,
            "sum_prefill_tokens": 200,
            "var_prefill_length": 0.0,
            "sum_prefill_kv_tokens": 64,
            "num_decode_requests": 2,
            "sum_decode_kv_tokens": 150,
            "var_decode_kv_tokens": 625.0,  # 100 and 50 about their mean 75
        },
        "queued_requests": {
            "num_prefill_requests": 2,
            "sum_prefill_tokens": 500,
            "var_prefill_length": 2500.0,  # 200 and 300 about 250
            "num_decode_requests": 1,
            "sum_decode_kv_tokens": 300,
            "var_decode_kv_tokens": 0.0,
        },
    }
    second = {
        **first,
        "counter_id": 2,
        "wall_time": 0.012,
        "scheduled_requests": {
            "num_prefill_requests": 2,
            "sum_prefill_tokens": 250,
            "var_prefill_length": 10000.0,  # prompts 100 and 300 about 200
            "sum_prefill_kv_tokens": 0,
            "num_decode_requests": 0,
            "sum_decode_kv_tokens": 0,
            "var_decode_kv_tokens": 0.0,
        },
        "queued_requests": NO_QUEUE,
    }
    assert _captured(tmp_path / "trace" / "fpm.jsonl") == [
        {"received_at_ns": STARTED_NS + 10_000_000, "metrics": first},  # at 0.01 s
        {"received_at_ns": STARTED_NS + 20_000_000, "metrics": second},
    ]


@pytest.mark.parametrize("batch_queue", [False, True], ids=["sync", "batch-queue"])
def test_each_traced_step_is_one_fpm_of_dynamos_shape(tmp_path, batch_queue, capsys):
    trace = made_trace(tmp_path, batch_queue)
    assert export([str(trace), "--to", "fpm"]) == 0
    (written,) = trace.glob("trace-dp0*.jsonl")  # one file, however the recorder names it
    lines = [json.loads(x) for x in written.read_text().splitlines()[1:]]
    captured = _captured(trace / "fpm.jsonl")
    assert f"{len(lines)} forward-pass metrics of 1 rank(s)" in capsys.readouterr().out
    theirs = json.loads(FIXTURE.read_text())["results"][0]["fpms"][0]
    shape = {k: t for k, t in _json_types(theirs).items() if not k.startswith("kvwarm_")}
    assert len(captured) == len(lines)
    for fpm, line in zip(captured, lines):
        metrics = fpm["metrics"]
        assert sorted(fpm) == ["metrics", "received_at_ns"] and isinstance(fpm["received_at_ns"], int)
        assert _json_types(metrics) == shape
        assert metrics["counter_id"] == line["step"] + 1 and metrics["dp_rank"] == 0
        assert metrics["wall_time"] == (line["wall"] if line["wall"] is not None else line["span"]) > 0
        # the step's requests as the raw line lists them (the composition: the test above)
        raw = len(line["new"]) + len(line["cached"]["scheduled"])
        s = metrics["scheduled_requests"]
        assert s["num_decode_requests"] + s["num_prefill_requests"] == raw > 0
    at = [fpm["received_at_ns"] for fpm in captured]
    assert at == sorted(at) and at[-1] - at[0] == pytest.approx((lines[-1]["at"] - lines[0]["at"]) * 1e9, abs=2e3)


def test_ranks_merge_in_the_order_of_their_steps_and_a_torn_line_is_reported(tmp_path, capsys):
    trace = made_trace(tmp_path)
    _, steps = read(trace)
    [rank_0] = current_files(trace)
    lines = rank_0.read_text().splitlines()
    first = {**json.loads(lines[0]), "dp_size": 2}  # two ranks of one deployment, as the reader requires
    rank_0.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    later = [json.dumps({**first, "rank": 1})]
    later += [json.dumps({**json.loads(x), "at": json.loads(x)["at"] + 0.0005}) for x in lines[1:]]
    (trace / "trace-dp1.jsonl").write_text("\n".join(later) + '\n{"step": 99, "at"')
    assert export([str(trace), "--to", "fpm", "--out", str(tmp_path / "out" / "fpm.jsonl")]) == 0
    assert "torn last line, skipped" in capsys.readouterr().err
    captured = _captured(tmp_path / "out" / "fpm.jsonl")
    order = [(c["metrics"]["dp_rank"], c["metrics"]["counter_id"]) for c in captured]
    assert order == [(rank, s.number + 1) for s in steps for rank in (0, 1)]


def test_rotated_files_are_read_oldest_first(tmp_path):
    out = rotated_trace(tmp_path, files=4, requests=6, max_tokens=40)
    assert len(list(out.glob("trace-dp0-*.3.jsonl"))) == 1
    assert export([str(out), "--to", "fpm"]) == 0
    counters = [c["metrics"]["counter_id"] for c in _captured(out / "fpm.jsonl")]
    assert counters == list(range(counters[0], counters[0] + len(counters)))


def test_a_trace_given_to_the_sweep_exports_and_a_folder_without_one_are_refused(tmp_path, capsys):
    trace = made_trace(tmp_path)
    assert export([str(trace), "--to", "dynamo"]) == 2
    assert "is a served-step trace, not a sweep: export it with --to fpm" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export([str(empty), "--to", "fpm"]) == 2
    assert "no trace-dp<R>.jsonl here" in capsys.readouterr().err
    shutil.rmtree(trace)
