"""What the tests of `python -m vllm.kvwarm report` share (test_report*.py): artifacts of
schema v1 (written out here, as the sweep wrote them then), of today's schema (made by the
sweep's own builder) and of schema 2 (today's, stripped as that schema had it), a run folder
to save one in, and a figure's legend."""

from __future__ import annotations

import json

from vllm.kvwarm.record.artifact import KvwarmMeta, PointRow, build_artifact
from vllm.kvwarm.record.schema import validate
from vllm.kvwarm.sweep.rows import NOISY_SPREAD

META_V1 = {
    "enabled": True,
    "warm_eligible": True,
    "skip_reason": None,
    "points_real_kv": 3,
    "points_fake_fallback": 1,
    "giant_kv_repeats": 3,
    "giant_kv_threshold": 1_000_000,
    "state_mode_requested": None,
    "state_mode": None,
    "reset_prefix_cache": True,
    "stages": [{"batch": 4, "depth": 1004, "build_seconds": 2.5}],
    "dataset": {
        "path": "/d/sharegpt.json",
        "sha256": "ab" * 32,
        "collection_pool": "conversation_sha256_even",
        "conversations": 64,
    },
}


def _row(k, b, regime, steps, reasons=None):
    return {
        "point": {"total_kv_read_tokens": k, "batch_size": b},
        "kv_seed_regime": regime,
        "sample_reasons": reasons or ([f"kvwarm_{regime}"] if regime != "legacy" else []),
        "steady_seconds": steps,
        "median_seconds": sorted(steps)[len(steps) // 2],
    }


def v1_artifact(status="complete", error=None):
    """Today's artifact (schema 1): no build, layout, hardware, min or max."""
    return {
        "schema_version": 1,
        "status": status,
        "error": error,
        "config": {"points": "/bench/points.json", "model": "/models/tiny-qwen3-moe"},
        "kvwarm": META_V1,
        "results": [
            _row(1000, 4, "real_kv", [0.010, 0.012, 0.011]),
            _row(2000, 4, "real_kv", [0.020, 0.021, 0.022]),
            _row(4000, 4, "fake_fallback", [0.040, 0.041, 0.043]),
            _row(1000, 1, "real_kv", [0.004, 0.005, 0.0045]),
        ],
        "skipped_points": [
            {
                "point": {"total_kv_read_tokens": 9000, "batch_size": 4},
                "kv_seed_regime": "skip:decode_injection_failed",
                "reason": "pool_exhausted: 3 more free block(s) needed",
            }
        ],
    }


RUN = {
    "started_at": "2026-11-30T14:00:00Z",
    "finished_at": "2026-11-30T14:03:10Z",
    "torch": "2.13.0+cpu",
    "build": {
        "version": "9.9.1+kvwarm.3",
        "release": "9.9.1",
        "flavour": "cpu",
        "series_digest": "d" * 16,
        "overlay_digest": "e" * 16,
        "revision": "abc1234",
    },
    "hardware": {"cpu": "AMD EPYC 7B13", "cores": 2, "gpus": [], "driver": None, "cuda_runtime": None},
    "engine_args": {
        "given": ["--model", "/models/tiny-qwen3-moe", "--enforce-eager"],
        "resolved": {
            "block_sizes": {"0:FullAttentionSpec": 16},
            "max_num_seqs": 8,
            "max_num_batched_tokens": 2048,
            "max_model_len": 2048,
            "dtype": "float32",
            "kv_cache_dtype": "auto",
            "enable_prefix_caching": True,
            "mamba_cache_mode": None,
            "enforce_eager": True,
            "cudagraph_mode": None,
        },
    },
}
LAYOUT = {
    "data_parallel_size": 1,
    "data_parallel_rank": 0,
    "tensor_parallel_size": 2,
    "pipeline_parallel_size": 1,
    "expert_parallel": True,
}


def rank_artifact(
    medians_ms=(10.0, 20.0), regime="real_kv", status="complete", reasons=None, extra=(), data_parallel_size=1
):
    """A rank artifact of today's schema at B=4, K 1000 and 2000 (as many as medians are given),
    with the given medians and `extra` rows, made by the sweep's own writer."""
    rows = []
    for k, m in zip((1000, 2000), medians_ms):
        steps = [m * 0.98 / 1e3, m / 1e3, m * 1.04 / 1e3]
        stamps = reasons or ([f"kvwarm_{regime}"] if regime != "legacy" else [])
        rows.append(PointRow(k, 4, regime, list(stamps), steps, m / 1e3))
    rows += extra
    meta = KvwarmMeta(
        enabled=True,
        warm_eligible=True,
        giant_kv_repeats=3,
        giant_kv_threshold=1_000_000,
        reset_prefix_cache=True,
        stages=[{"batch": 4, "depth": 1004, "build_seconds": 2.5}],
        dataset=META_V1["dataset"],
        noisy_spread=NOISY_SPREAD,
    )
    error = None if status != "failed" else "rank 0: RuntimeError: pool exhausted"
    artifact = build_artifact(
        rows,
        meta,
        {"points": "/bench/points.json", "model": "/models/tiny-qwen3-moe"},
        status,
        error,
        run=RUN,
        layout={**LAYOUT, "data_parallel_size": data_parallel_size},
    )
    validate(artifact)
    return {**artifact, "a_field_from_the_future": {"ignored": True}}


def as_schema_2(artifact: dict) -> dict:
    """What the same rank artifact was under schema 2 (the writer of that schema is gone): the
    type tag "rank", points without point_type or prefill tokens, rows without phases or graph."""
    old = {**artifact, "schema_version": 2, "artifact_type": "rank"}
    old["results"] = [
        {
            **{k: x for k, x in r.items() if k not in ("phases", "graph")},
            "point": {
                "total_kv_read_tokens": r["point"]["total_kv_read_tokens"],
                "batch_size": r["point"]["batch_size"],
            },
        }
        for r in artifact["results"]
    ]
    return old


def save(folder, artifact) -> str:
    """`artifact` (a dict, or text as it is) saved as folder/sweep.json; the folder's path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sweep.json").write_text(artifact if isinstance(artifact, str) else json.dumps(artifact))
    return str(folder)


def legend(fig) -> list[str]:
    """The texts of the first axes' legend."""
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
