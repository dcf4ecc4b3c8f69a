"""Mixed points through `python -m vllm.kvwarm sweep` on the real CPU engine (a tiny attention
MoE with expert parallel, one rank): each timed step holds the decode part's shadows and the
prefill part's shot on real KV, or the point would be skipped; the row is of type `mixed` in
sweep.json and sweep.csv. A mixed point over the token budget given on the command line is
refused before the engine starts.

Runs in its own pytest process (`-m command`): the command starts its own engine.
"""

from __future__ import annotations

import csv
import json

import pytest
from test_sweep_command import ENGINE_ARGS, _moe_sweep

pytestmark = pytest.mark.command


def _points(tmp_path, prefill_tokens: int) -> str:
    points = tmp_path / "points.json"
    part = {"total_prefill_tokens": prefill_tokens, "total_kv_read_tokens": 128, "batch_size": 1}
    mixed = {"decode": {"total_kv_read_tokens": 300, "batch_size": 2}, "prefill": part}
    points.write_text(json.dumps({"schema_version": 2, "mixed": [mixed]}))
    return str(points)


def test_a_mixed_point_is_measured_as_one_step_of_decodes_and_a_prefill_on_real_kv(tmp_path, monkeypatch):
    artifact = _moe_sweep(tmp_path, monkeypatch, "--points", _points(tmp_path, 96))
    (row,) = artifact["results"]
    assert row["point"] == {
        "point_type": "mixed",
        "total_kv_read_tokens": 428,
        "batch_size": 3,
        "total_prefill_tokens": 96,
        "decode": {"batch_size": 2, "total_kv_read_tokens": 300},
        "prefill": {"batch_size": 1, "total_prefill_tokens": 96, "total_kv_read_tokens": 128},
    }
    assert (row["kv_seed_regime"], row["sample_kind"]) == ("real_kv", "shot_forward")
    assert {"prefill_real_seed", "kvwarm_real_kv"} <= set(row["sample_reasons"])
    assert len(row["steady_seconds"]) == 3 and all(t > 0 for t in row["steady_seconds"])
    assert row["median_seconds"] == sorted(row["steady_seconds"])[1] == row["phases"]["forward"]
    (line,) = csv.DictReader((tmp_path / "out" / "sweep.csv").open())
    assert (line["point_type"], line["decode_batch_size"], line["decode_kv_read_tokens"]) == ("mixed", "2", "300")


def test_continuation_points_run_their_chunks_on_running_requests_on_real_kv(tmp_path, monkeypatch):
    """A continuation prefill point and a mixed point with a continuation part (schema 3): each
    shot a lead step, then the timed step of the same requests, running; a step of any other
    shape would skip the point by name."""
    points = tmp_path / "points.json"
    part = {"total_prefill_tokens": 64, "total_kv_read_tokens": 128, "batch_size": 2, "continuation": True}
    mixed = {"decode": {"total_kv_read_tokens": 300, "batch_size": 2}, "prefill": part}
    points.write_text(json.dumps({"schema_version": 3, "prefill": [part], "mixed": [mixed]}))
    artifact = _moe_sweep(tmp_path, monkeypatch, "--points", str(points))
    assert not artifact["skipped_points"], artifact["skipped_points"]
    prefill, mixed_row = artifact["results"]
    assert prefill["point"] == {
        "point_type": "prefill",
        "total_kv_read_tokens": 128,
        "batch_size": 2,
        "total_prefill_tokens": 64,
        "continuation": True,
    }
    assert prefill["kv_seed_regime"] == "real_prefix" and len(prefill["steady_seconds"]) == 3
    assert mixed_row["point"]["prefill"]["continuation"] is True and mixed_row["kv_seed_regime"] == "real_kv"
    lines = list(csv.DictReader((tmp_path / "out" / "sweep.csv").open()))
    assert [line["continuation"] for line in lines] == ["1", "1"]


def test_a_mixed_point_over_the_given_token_budget_is_refused_before_the_engine_starts(tmp_path, monkeypatch, capsys):
    from kvwarm_testing.real_kv import tiny_llama_config
    from vllm.kvwarm.sweep.command import run

    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")  # no dataset needed: the point is refused first
    out = tmp_path / "out"
    model = tiny_llama_config(tmp_path / "config-only")  # no weights: the engine never starts
    # 2 decode tokens + 255 prefill tokens > --max-num-batched-tokens 256
    assert run(["--points", _points(tmp_path, 255), "--out", str(out), "--model", str(model), *ENGINE_ARGS]) == 2
    error = capsys.readouterr().err
    assert "mixed point decode B=2 K=300 + prefill B=1 N=255 P=128" in error
    assert "--max-num-batched-tokens 257 or more" in error
    assert json.loads((out / "sweep.json").read_text())["status"] == "failed"
