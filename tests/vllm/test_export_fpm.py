"""`export TRACE --to fpm`: a served-step trace written by the real recorder (the real
Scheduler stepped by kvwarm_testing.recorded) as Dynamo's forward-pass metrics capture. Each
FPM is held against its trace line and against the shape of the FPMs Dynamo 1.6.1 itself
wrote (tests/fixtures/dynamo-1.6.1: the same keys with the same JSON types); Dynamo's own
struct reads them in tests/engine/test_export_consumers.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kvwarm_testing.recorded import current_files, made_trace, read, rotated_trace
from vllm.kvwarm.record.export.command import run as export

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dynamo-1.6.1" / "benchmark_decode.json"


def _json_types(value) -> object:
    if isinstance(value, dict):
        return {k: _json_types(v) for k, v in value.items()}
    return type(value).__name__


def _captured(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("batch_queue", [False, True], ids=["sync", "batch-queue"])
def test_each_traced_step_is_one_fpm_of_dynamos_shape(tmp_path, batch_queue, capsys):
    trace = made_trace(tmp_path, batch_queue)
    assert export([str(trace), "--to", "fpm"]) == 0
    _, steps = read(trace)
    captured = _captured(trace / "fpm.jsonl")
    assert f"{len(steps)} forward-pass metrics of 1 rank(s)" in capsys.readouterr().out
    theirs = json.loads(FIXTURE.read_text())["results"][0]["fpms"][0]
    shape = {k: t for k, t in _json_types(theirs).items() if not k.startswith("kvwarm_")}
    assert len(captured) == len(steps)
    for line, step in zip(captured, steps):
        metrics = line["metrics"]
        assert sorted(line) == ["metrics", "received_at_ns"] and isinstance(line["received_at_ns"], int)
        assert _json_types(metrics) == shape
        assert metrics["counter_id"] == step.number + 1 and metrics["dp_rank"] == 0
        assert metrics["wall_time"] == (step.wall if step.wall is not None else step.span) > 0
        s, q = metrics["scheduled_requests"], metrics["queued_requests"]
        assert (s["num_decode_requests"], s["sum_decode_kv_tokens"]) == (step.decode_requests, step.decode_kv_tokens)
        assert (s["num_prefill_requests"], s["sum_prefill_tokens"], s["sum_prefill_kv_tokens"]) == (
            step.prefill_requests,
            step.prefill_new_tokens,
            step.prefill_prefix_tokens,
        )
        assert s["var_prefill_length"] == step.prefill_prompt_var
        assert (q["num_prefill_requests"], q["sum_prefill_tokens"]) == (step.queued["requests"], step.queued["tokens"])
    at = [line["received_at_ns"] for line in captured]
    assert at == sorted(at) and at[-1] - at[0] == pytest.approx((steps[-1].at - steps[0].at) * 1e9, abs=2e3)


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
