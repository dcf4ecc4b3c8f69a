"""`python -m vllm.kvwarm sweep` end to end on the real CPU engine: a tiny Llama, a small
ShareGPT-format file made here, three points over two rungs. Every point is measured on
real KV, the artifact validates, and the run ends with reset_prefix_cache() succeeding.

Runs in its own pytest process (`-m command`): the command starts its own engine.
"""

from __future__ import annotations

import csv
import json
import platform

import pytest

pytestmark = pytest.mark.command


def test_a_sweep_writes_a_complete_artifact_with_every_point_on_real_kv(tmp_path, monkeypatch):
    from kvwarm_testing.tiny_models import make_tiny_llama, write_sharegpt
    from vllm.kvwarm.record.schema import validate
    from vllm.kvwarm.sweep.command import run

    model = make_tiny_llama(tmp_path / "tiny-llama")
    points = tmp_path / "points.json"
    points.write_text(
        json.dumps(
            {
                "schema_version": 1,
                "decode": [
                    {"total_kv_read_tokens": 300, "batch_size": 2},
                    {"total_kv_read_tokens": 120, "batch_size": 2},
                    {"total_kv_read_tokens": 90, "batch_size": 3},
                ],
            }
        )
    )
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP_DATASET", str(write_sharegpt(tmp_path / "sharegpt.json")))
    monkeypatch.setenv("DYN_BENCH_GIANT_KV_REPEATS", "3")
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "force")  # a dense model: the gate would skip it
    out = tmp_path / "out"
    rc = run(
        [
            "--points",
            str(points),
            "--out",
            str(out),
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            "1024",
            "--block-size",
            "32",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "256",
            "--enable-prefix-caching",
            "--seed",
            "0",
        ]
    )
    assert rc == 0
    artifact = json.loads((out / "sweep.json").read_text())
    validate(artifact)
    assert artifact["status"] == "complete" and artifact["skipped_points"] == []
    meta = artifact["kvwarm"]
    assert meta["points_real_kv"] == 3 and meta["reset_prefix_cache"] is True
    assert (meta["warm_eligible"], meta["skip_reason"]) == (True, None)
    assert 0 < meta["dataset"]["conversations"] < 64  # the collection half of the file
    # the collector: vLLM's EngineCore froze its heap at start, so the sweep's freezes were
    # undone and the heap frozen again; one rank's worker runs in this process, held with it
    gc_record = meta["gc"]
    assert gc_record["policy"] == "held" and gc_record["collections_between_points"] == 3
    assert (gc_record["engine_froze_heap"], gc_record["heap_at_end"]) == (True, "refrozen")
    assert gc_record["workers"] == {"policy": "in_scheduler_process", "processes": 0}
    assert [(s["batch"], s["depth"]) for s in meta["stages"]] == [(3, 29 + 1 + 3), (2, 149 + 1 + 3)]
    assert sorted((r["point"]["batch_size"], r["point"]["total_kv_read_tokens"]) for r in artifact["results"]) == [
        (2, 120),
        (2, 300),
        (3, 90),
    ]
    for row in artifact["results"]:
        assert row["kv_seed_regime"] == "real_kv" and len(row["steady_seconds"]) == 3
        assert row["median_seconds"] == sorted(row["steady_seconds"])[1] > 0
        assert (row["min_seconds"], row["max_seconds"]) == (min(row["steady_seconds"]), max(row["steady_seconds"]))
        assert row["spread"] == pytest.approx((row["max_seconds"] - row["min_seconds"]) / row["median_seconds"])
        assert row["global_batch_size"] == row["point"]["batch_size"]
    # the measurement record: what ran, on what, when
    assert artifact["schema_version"] == 3 and artifact["artifact_type"] == "kvwarm.rank"
    assert artifact["build"]["version"].endswith(artifact["build"]["version"].split("+")[1])
    assert artifact["build"]["flavour"] == "cpu" and len(artifact["build"]["series_digest"]) == 64
    assert artifact["layout"] == {
        "data_parallel_size": 1,
        "data_parallel_rank": 0,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "expert_parallel": False,
    }
    assert artifact["hardware"]["cores"] >= 1 and artifact["hardware"]["cpu"] and artifact["hardware"]["gpus"] == []
    import torch

    assert artifact["torch"] == torch.__version__
    assert artifact["started_at"] <= artifact["finished_at"]
    resolved = artifact["config"]["engine_args"]["resolved"]
    assert (resolved["max_num_seqs"], resolved["max_num_batched_tokens"], resolved["max_model_len"]) == (8, 256, 1024)
    assert resolved["dtype"] == "float32" and resolved["enable_prefix_caching"] is True
    assert resolved["enforce_eager"] is True and list(resolved["block_sizes"].values()) == [32]
    assert resolved["model_type"] == "llama" and resolved["architectures"] == ["LlamaForCausalLM"]
    assert resolved["enable_chunked_prefill"] is True and resolved["async_scheduling"] is False  # the CPU platform
    assert resolved["distributed_executor_backend"] == "uni"  # the engine core and its model in this process
    # one step at a time on CPU, so the command picked the sync adapter
    assert artifact["kvwarm"]["engine_loop"] == {
        "loop": "sync",
        "scheduler_cls": "vllm.kvwarm.scheduler.KvWarmScheduler",
        "async_scheduling": False,
        "batch_queue_size": 1,
    }
    assert artifact["hardware"]["python"] == platform.python_version()
    assert "--max-num-seqs" in artifact["config"]["engine_args"]["given"]
    assert len(list(csv.DictReader((out / "sweep.csv").open()))) == 3
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:  # the PNG is drawn only where it imports
        assert (out / "sweep.png").read_bytes().startswith(b"\x89PNG")
    else:
        assert not (out / "sweep.png").exists()


ENGINE_ARGS = [
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    "1024",
    "--block-size",
    "32",
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "256",
    "--enable-prefix-caching",
    "--seed",
    "0",
    "--enable-expert-parallel",
]


def _moe_sweep(tmp_path, monkeypatch, *what: str) -> dict:
    from kvwarm_testing.engine import fp32_moe_refusal, skip_where_refused
    from kvwarm_testing.tiny_models import make_tiny_qwen3_moe, write_sharegpt
    from vllm.kvwarm.record.schema import validate
    from vllm.kvwarm.sweep.command import run

    skip_where_refused(fp32_moe_refusal())
    model = make_tiny_qwen3_moe(tmp_path / "tiny-qwen3-moe")
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP_DATASET", str(write_sharegpt(tmp_path / "sharegpt.json")))
    monkeypatch.setenv("DYN_BENCH_GIANT_KV_REPEATS", "3")
    monkeypatch.delenv("DYN_BENCH_KV_WARMUP", raising=False)  # an MoE with EP: the gate admits it
    out = tmp_path / "out"
    assert run([*what, "--out", str(out), "--model", str(model), *ENGINE_ARGS]) == 0
    artifact = json.loads((out / "sweep.json").read_text())
    validate(artifact)
    assert artifact["status"] == "complete" and artifact["skipped_points"] == []
    assert artifact["kvwarm"]["reset_prefix_cache"] is True
    return artifact


def test_a_points_file_with_prefill_and_decode_points_runs_them_all_on_real_kv(tmp_path, monkeypatch):
    points = tmp_path / "points.json"
    points.write_text(
        json.dumps(
            {
                "schema_version": 1,
                "prefill": [
                    {"total_prefill_tokens": 96, "total_kv_read_tokens": 128, "batch_size": 2},
                    {"total_prefill_tokens": 64, "total_kv_read_tokens": 0, "batch_size": 2},
                    {"total_prefill_tokens": 50, "total_kv_read_tokens": 256, "batch_size": 1},
                ],
                "decode": [{"total_kv_read_tokens": 300, "batch_size": 2}],
            }
        )
    )
    artifact = _moe_sweep(tmp_path, monkeypatch, "--points", str(points))
    rows = [
        (
            r["point"]["point_type"],
            r["point"]["total_prefill_tokens"],
            r["point"]["total_kv_read_tokens"],
            r["point"]["batch_size"],
            r["kv_seed_regime"],
        )
        for r in artifact["results"]
    ]
    assert rows == [
        ("prefill", 96, 128, 2, "real_prefix"),
        ("prefill", 64, 0, 2, "not_applicable"),
        ("prefill", 50, 256, 1, "real_prefix"),
        ("decode", 0, 300, 2, "real_kv"),
    ]
    for row in artifact["results"]:
        assert len(row["steady_seconds"]) == 3 and all(t > 0 for t in row["steady_seconds"])
        assert set(row["phases"]) == {"schedule", "forward", "update", "sweep", "other"}
        assert row["graph"]["reasons"] == ["cudagraph_disabled"]  # CPU, eager
    prefill = artifact["results"][0]
    # a shot's time is its own step's forward (3 shots: the row's median is its forward phase's
    # median), and its phases split the shots' own spans (nothing else in them)
    assert prefill["median_seconds"] == sorted(prefill["steady_seconds"])[1] == prefill["phases"]["forward"]
    assert prefill["phases"]["other"] == 0


def test_a_grid_sweep_lays_its_axes_around_the_capture_sizes_it_is_given(tmp_path, monkeypatch):
    """The CPU platform clears the engine's capture sizes, so the grid is given a target's:
    1, 2, 4 and 128. Its decode batches keep every C / C + 1 pair up to the limit
    (max_num_seqs 8); the prefill axis's doubling tail would start at 256, the limit
    (max_num_batched_tokens), so a cap of 2 keeps its first unit and the limit."""
    caps = {"decode_batches": 20, "kv_ladder": 2, "prefill_tokens": 2, "mixed": 1, "capture_sizes": [1, 2, 4, 128]}
    artifact = _moe_sweep(tmp_path, monkeypatch, "--grid", json.dumps(caps))
    grid = artifact["kvwarm"]["grid"]
    assert grid["decode_batches"] == [1, 2, 3, 4, 5, 8]
    assert grid["prefill_tokens"] == [1, 2, 3, 4, 5, 256]  # B = 1: 1, 2, 3 and 256; B = 4: 4, 5 and 256
    assert grid["points"] == len(artifact["results"]) and (tmp_path / "out" / "grid.json").exists()
    # one data-parallel rank of an attention-only model: the grid lays mixed points too
    assert {r["point"]["point_type"] for r in artifact["results"]} == {"prefill", "decode", "mixed"}
    assert grid["mixed_note"] is None
    assert artifact["kvwarm"]["cudagraph"]["mode"] == "NONE"
