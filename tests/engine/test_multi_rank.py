"""Sweeps on several ranks of the real CPU engine (vLLM's own processes: the API server and
the sweep command with --data-parallel-size / --tensor-parallel-size): every rank completes
with the same plan, per-rank and combined artifacts agree, outside requests never enter a
timed step, a failure stops every rank without a hang, and the server serves on.

Runs in its own pytest process (`-m multirank`); this process starts no engine itself. The
MoE case and the forced plan mismatch need the test-only plugin (kvwarm_test_plugin).
"""

from __future__ import annotations

import json
import threading

import pytest
from kvwarm_testing.multi_rank import (
    ADAPTER,
    api_server,
    engine_args,
    medians_by_point,
    run_command,
    wait_final,
    write_points,
)

pytestmark = pytest.mark.multirank

# 42 points over three rungs, contexts up to 300 tokens (batch per rank)
POINTS = [(k, b) for b in (1, 2, 3) for k in range(60 * b, 60 * b + 14 * 40 * b, 40 * b)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from kvwarm_testing.tiny_models import make_tiny_llama, make_tiny_qwen3_moe, write_sharegpt

    root = tmp_path_factory.mktemp("multirank")
    return {
        "llama": make_tiny_llama(root / "tiny-llama"),
        "moe": make_tiny_qwen3_moe(root / "tiny-moe"),
        "dataset": write_sharegpt(root / "sharegpt.json"),
        "root": root,
    }


def _env(inputs, **extra) -> dict:
    return {"DYN_BENCH_KV_WARMUP_DATASET": str(inputs["dataset"]), "DYN_BENCH_KV_WARMUP": "force", **extra}


def _check_ranks(out, size: int, points) -> tuple[dict, list[dict]]:
    """Every rank complete on real KV with the same stages, and the combined view agreeing."""
    from vllm.kvwarm.record.schema import validate

    combined = json.loads((out / "sweep.json").read_text())
    ranks = [json.loads((out / f"dp{r}" / "sweep.json").read_text()) for r in range(size)]
    for rank, artifact in enumerate(ranks):
        validate(artifact)
        assert artifact["status"] == "complete", artifact["error"]
        assert artifact["layout"]["data_parallel_rank"] == rank and artifact["layout"]["data_parallel_size"] == size
        assert artifact["skipped_points"] == [] and len(artifact["results"]) == len(points)
        assert {r["kv_seed_regime"] for r in artifact["results"]} == {"real_kv"}
        assert artifact["kvwarm"]["reset_prefix_cache"] is True
    stages = [[(s["batch"], s["depth"]) for s in a["kvwarm"]["stages"]] for a in ranks]
    assert all(s == stages[0] for s in stages), stages
    validate(combined)
    assert combined["status"] == "complete" and combined["artifact_type"] == "kvwarm.combined"
    assert [(r["rank"], r["status"], r["rows"]) for r in combined["ranks"]] == [
        (r, "complete", len(points)) for r in range(size)
    ]
    per_rank = [medians_by_point(a) for a in ranks]
    for row in combined["results"]:
        key = (row["point"]["total_kv_read_tokens"], row["point"]["batch_size"])
        assert row["median_seconds"] == max(m[key] for m in per_rank)
        assert row["global_batch_size"] == key[1] * size
    return combined, ranks


def test_a_data_parallel_server_sweeps_on_every_rank_and_serves_on(inputs, tmp_path):
    out = tmp_path / "out"
    spec = {"points": str(write_points(tmp_path / "points.json", POINTS)), "out": str(out)}
    args = engine_args(
        inputs["llama"],
        "--data-parallel-size",
        "2",
        "--scheduler-cls",
        ADAPTER,
        "--additional-config",
        json.dumps({"kvwarm_sweep": spec}),
    )
    answers = []
    with api_server(args, _env(inputs), tmp_path / "server.log") as server:

        def users():  # outside requests while the sweep runs
            for n in range(6):
                answers.append(server.complete(f"decode prefill cache {n}", max_tokens=8))

        thread = threading.Thread(target=users)
        thread.start()
        combined = wait_final(out / "sweep.json")
        thread.join(timeout=300)
        assert combined["status"] == "complete", combined["error"]
        after = server.complete("the sweep is over", max_tokens=4)
    _check_ranks(out, 2, POINTS)  # every point measured with exactly B: none skipped
    assert len(answers) == 6 and all(a["choices"][0]["text"] for a in answers)
    assert after["usage"]["completion_tokens"] == 4


def test_a_plan_mismatch_fails_every_rank_and_the_command_without_a_hang(inputs, tmp_path):
    out = tmp_path / "out"
    rc = run_command(
        [
            "--points",
            str(write_points(tmp_path / "points.json", POINTS[:3])),
            "--out",
            str(out),
            *engine_args(inputs["llama"], "--data-parallel-size", "2"),
        ],
        _env(inputs, KVWARM_TEST_PLAN_SKEW="1"),
        tmp_path / "cmd.log",
        timeout=600,
    )
    assert rc == 1
    combined = json.loads((out / "sweep.json").read_text())
    assert combined["status"] == "failed"
    for rank in combined["ranks"]:
        assert rank["status"] == "failed" and "plan mismatch before rung batch=1" in rank["error"]
        assert rank["rows"] == 0


def test_the_command_sweeps_an_moe_model_in_lockstep_on_two_data_parallel_ranks(inputs, tmp_path):
    """`python -m vllm.kvwarm sweep --data-parallel-size 2` exits 0 once both ranks completed."""
    out = tmp_path / "out"
    points = POINTS[::3]
    rc = run_command(
        [
            "--points",
            str(write_points(tmp_path / "points.json", points)),
            "--out",
            str(out),
            *engine_args(inputs["moe"], "--data-parallel-size", "2"),
        ],
        _env(inputs, KVWARM_TEST_CPU_ALL_GATHERV="1"),
        tmp_path / "cmd.log",
    )
    assert rc == 0, (tmp_path / "cmd.log").read_text()[-3000:]
    _check_ranks(out, 2, points)


def test_a_tensor_parallel_sweep_measures_every_point_on_real_kv(inputs, tmp_path):
    from vllm.kvwarm.record.schema import validate

    out = tmp_path / "out"
    points = POINTS[::4]
    rc = run_command(
        [
            "--points",
            str(write_points(tmp_path / "points.json", points)),
            "--out",
            str(out),
            *engine_args(inputs["moe"], "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"),
        ],
        _env(inputs),
        tmp_path / "cmd.log",
    )
    assert rc == 0, (tmp_path / "cmd.log").read_text()[-3000:]
    artifact = json.loads((out / "sweep.json").read_text())
    validate(artifact)
    assert artifact["layout"]["tensor_parallel_size"] == 2 and artifact["layout"]["data_parallel_size"] == 1
    assert artifact["status"] == "complete" and len(artifact["results"]) == len(points)
    assert {r["kv_seed_regime"] for r in artifact["results"]} == {"real_kv"}
