"""A sweep as Dynamo's self-benchmark artifact: one file per data-parallel rank and kind of
point (or both kinds in one, as Dynamo's agg mode: AGG), every envelope field Dynamo 1.6.1's
self-benchmark writes (schema_version 2, artifact_type "rank"), each holding what it holds
there (docs/export.md, field by field).
This module is the envelope and its validity (Dynamo's formulas); the rows are
record.export.dynamo_rows', the engine's provenance record.export.dynamo_engine's.

What is ours and has no field of theirs goes into `kvwarm_sweep` blocks (at the top, in each
result and in each skipped point): every timed sample, the phases, our own stamps per rank,
the run record, and `unfilled`, the paths of Dynamo's fields this sweep's record cannot fill
(written null) with why. Our stamps also go into the point's `sample_reasons`.

Plain data: nothing here imports vLLM.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path

from .. import vocabulary as v
from ..shape import point_key
from .dynamo_engine import (
    NOT_RECORDED,
    block_size,
    cudagraph_block,
    engine_layout,
    engine_provenance,
    mark_nulls,
    recorded_graphs,
    resolved_args,
)
from .dynamo_rows import NAMESPACE, KindRows, agg_rows, kind_rows

SCHEMA_VERSION = 2  # Dynamo's artifact, not ours
AGG = "agg"  # Dynamo's mode of a run of both kinds: the prefill points, then the decode points
WARMED = (v.DECODE, AGG)  # the modes whose artifact has Dynamo's warm-up block and decode limits
ARTIFACT_TYPE = "rank"
# How a result's wall_time was measured (Dynamo's: "steady_state_second_step" / "single_step").
MEASUREMENT_POLICY = {
    v.DECODE: "kvwarm_upper_median_of_steady_steps",
    v.PREFILL: "kvwarm_upper_median_of_measured_shots",
}
SYNTHETIC_PROMPTS = "kvwarm_salted_sequence"  # fake-KV prompts: a salted arithmetic sequence
TIME_RESOLUTION = 1.0  # seconds: a sweep record's started_at / finished_at


def _time(stamp) -> datetime | None:
    try:
        return datetime.fromisoformat(stamp)
    except (TypeError, ValueError):
        return None


def _sha256(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def run_id(sweep) -> str:
    """One id for the run, the same on every rank and every export of it."""
    first = sweep.ranks[0]
    config = first.get("config") or {}
    return _sha256([first.get("started_at"), config.get("points"), config.get("model"), sweep.size])[:32]


def _span(artifact: dict) -> float | None:
    """Seconds from the rank's start to its end, as its record's times give them."""
    started, finished = _time(artifact.get("started_at")), _time(artifact.get("finished_at"))
    return (finished - started).total_seconds() if started and finished else None


def _capacity(sweep, kind: str) -> dict:
    """Dynamo's negotiated envelope: the smallest of every rank's."""
    resolved = [resolved_args(a) for a in sweep.ranks]

    def least(key):
        values = [r.get(key) for r in resolved]
        return min(values) if values and all(isinstance(x, int) for x in values) else None

    blocks = least("num_gpu_blocks")
    usable = None if blocks is None else max(0, blocks - 1)  # the null block is never free
    return {
        "max_model_len": least("max_model_len"),
        "max_num_scheduled_tokens": least("max_num_batched_tokens"),
        "max_num_running_reqs": least("max_num_seqs"),
        "usable_blocks_without_watermark": usable,
        "usable_blocks_with_watermark": usable,  # vLLM v1 keeps no watermark
        "grid_invariants_digest": _sha256(resolved[0]),
        "kvwarm_eligible": kind in WARMED
        and all((a.get("kvwarm") or {}).get("warm_eligible") is True for a in sweep.ranks),
    }


def rank_artifacts(sweep, kind: str, paths: list[Path]) -> list[dict]:
    """Dynamo's rank artifact of every rank for one kind of point, or both (AGG) (config.mode
    = kind); `paths`: where each rank's file goes (its config.output_path)."""
    graphs = recorded_graphs(sweep.ranks[0])
    rows = agg_rows(sweep, graphs) if kind == AGG else kind_rows(sweep, kind, graphs)
    measured_seconds = sum(g["wall_time"] for g in rows.groups)
    # every timed sample of the sweep (all kinds), the slowest rank's at each point: a floor
    # for every rank's elapsed time, since the ranks meet at each point's start
    per_point: dict[tuple, float] = {}
    for artifact in sweep.ranks:
        for row in artifact.get("results", []):
            key = point_key(row["point"])
            per_point[key] = max(per_point.get(key, 0.0), sum(row.get("steady_seconds") or []))
    floor = max(sum(per_point.values()), measured_seconds)
    return [
        _rank_artifact(sweep, r, kind, paths[r], rows) | _timing_fields(sweep.ranks[r], measured_seconds, floor, rows)
        for r in range(sweep.size)
    ]


def _timing_fields(artifact: dict, measured_seconds: float, floor: float, rows: KindRows) -> dict:
    """What Dynamo derives from its timing and coverage, by its formulas: `valid` needs every
    point of the grid measured on every rank, none skipped, no error and sound timing;
    `usable` the same but for the coverage."""
    # the record's times are whole seconds: the elapsed time is their span, never less than
    # the timed samples the rank ran (`floor`); the timing holds when the measured seconds
    # fit in that span, to its one-second resolution
    span = _span(artifact)
    elapsed = max(span or 0.0, floor)
    timing_valid = span is not None and measured_seconds <= span + TIME_RESOLUTION
    timing_valid = timing_valid and measured_seconds <= elapsed + 1e-12
    error = artifact.get("error")
    if error is None and artifact.get("status") == v.FAILED:
        error = "the sweep failed"
    expected, completed, groups, skipped = rows.expected, len(rows.everywhere), rows.groups, rows.skipped
    missing = rows.missing
    sound = len(groups) == completed and all(g["complete"] for g in groups) and not skipped and not missing
    sound = sound and timing_valid and error is None
    return {
        "status": "failed" if error is not None else "complete",
        "valid": completed == expected and sound,
        "usable": completed > 0 and sound,
        "timing_valid": timing_valid,
        "timing": {
            "started_at": artifact.get("started_at"),
            "completed_at": artifact.get("finished_at"),
            "benchmark_elapsed_seconds": float(elapsed),
            "measured_iteration_seconds": float(measured_seconds),
        },
        "coverage": {"expected_points": expected, "completed_points": completed, "skipped_points": len(skipped)},
        "missing_phases": missing,
        "error": error,
    }


def _rank_artifact(sweep, rank: int, kind: str, path: Path, rows: KindRows) -> dict:
    artifact = sweep.ranks[rank]
    size = sweep.size
    resolved = resolved_args(artifact)
    layout = engine_layout(artifact, rank, size)
    meta = artifact.get("kvwarm") or {}
    exchange = meta.get("exchange") or {}  # how the ranks met (absent: one rank, or an older sweep)
    cudagraph = cudagraph_block(artifact)
    unfilled: dict[str, str] = {}
    results = rows.results(rank, size)
    seqs, tokens = resolved.get("max_num_seqs"), resolved.get("max_num_batched_tokens")
    blocks = resolved.get("num_gpu_blocks")
    feasible = 0
    if kind in WARMED:
        known = [x for x in (seqs, tokens, None if blocks is None else blocks - 1) if isinstance(x, int)]
        feasible = max(0, min(known)) if len(known) == 3 else None
    out = {"schema_version": SCHEMA_VERSION}
    if kind in WARMED:  # Dynamo writes its warm-up's block in decode (and agg) runs only
        out["kvwarm"] = {
            "enabled": bool(meta.get("enabled")),
            "warm_eligible": bool(meta.get("warm_eligible")),
            "skip_reason": meta.get("skip_reason"),
            "dataset": meta.get("dataset"),
            "stages": list(meta.get("stages") or []),
            "points_real_kv": sum(r["kv_seed_regime"] == v.REAL_KV for r in results),
            "points_fake_fallback": sum(r["kv_seed_regime"] == v.FAKE_FALLBACK for r in results),
            "giant_kv_threshold": meta.get("giant_kv_threshold"),  # null: an artifact that predates it
            "giant_kv_repeats": meta.get("giant_kv_repeats", 1),
        }
    out |= {
        "artifact_type": ARTIFACT_TYPE,
        "status": None,  # these placeholders keep Dynamo's key order; _timing_fields fills them
        "valid": None,
        "usable": None,
        "stop_reason": None,  # Dynamo's soft timeout; the sweep has none
        "timing_valid": None,
        "run_id": run_id(sweep),
        "grid_digest": _sha256([rows.points[k] for k in rows.everywhere] + [s["point"] for s in rows.skipped]),
        "timing": None,
        "dp": {"rank": rank, "size": size},
        "synchronization": {"enabled": size > 1, "coordinator_rank": 0, "port": exchange.get("port")},
        "coverage": None,
        "config": {
            "mode": kind,
            "randomize_kda_state": False,
            "hybrid_live_state": False,
            "warmup_iterations": 0,  # no engine steps before the first point
            "output_path": str(path),
            "timeout": None,
            "prefill_max_new_token_samples": None,
            "prefill_max_kv_read_token_samples": None,
            "decode_max_kv_read_token_samples": None,
            "decode_max_batch_size_samples": None,
            "prefix_max_batch_size_samples": None,
            "max_batch_size": None,
            "collect_imbalanced": False,
        },
        "limits": {
            "max_num_scheduled_tokens": tokens,
            "max_num_running_reqs": seqs,
            "max_model_len": resolved.get("max_model_len"),
            "block_size": block_size(resolved),
            "num_gpu_blocks": blocks,
            "configured_max_batch_size": seqs,
            "feasible_max_batch_size": feasible,
        },
        "recurrent_state": {"initialization": "unchanged", "policy": None, "uniform_bound": None},
        "measurement_policy": dict(MEASUREMENT_POLICY),
        "synthetic_prompts": {"mode": SYNTHETIC_PROMPTS, "vocab_size": None},
        "capacity": {"common": _capacity(sweep, kind)},
        "cudagraph": cudagraph,
        "engine": engine_provenance(artifact, layout, resolved, cudagraph, unfilled),
        "results": results,
        "iteration_groups": rows.groups,
        "skipped_points": rows.skipped,
        "missing_phases": None,
        "error": None,
    }
    gaps = {
        "config.timeout": "the sweep has no soft timeout",
        **{
            f"config.{key}": "Dynamo's grid generator limits; the sweep measures its points file"
            for key in (
                "prefill_max_new_token_samples",
                "prefill_max_kv_read_token_samples",
                "decode_max_kv_read_token_samples",
                "decode_max_batch_size_samples",
                "prefix_max_batch_size_samples",
            )
        },
        "synthetic_prompts.vocab_size": NOT_RECORDED,
    }
    if size > 1 and exchange.get("port") is None:
        gaps["synchronization.port"] = (
            "the ranks met through files in the output folder, not a TCP port"
            if exchange.get("exchange") == "files"
            else f"{NOT_RECORDED} (a sweep older than its record of the ranks' exchange)"
        )
    unfilled |= gaps
    for block in ("kvwarm", "limits", "capacity", "cudagraph"):
        if block not in out:
            continue
        mark_nulls(out[block], block, unfilled)
    out[NAMESPACE] = {
        "exported_from": str(sweep.paths[rank]),
        "left_out": sweep.left_out,  # rows the export was asked to leave out (None: none)
        "schema_version": artifact.get("schema_version"),
        "artifact_type": artifact.get("artifact_type", v.RANK),
        "status": artifact.get("status"),
        "error": artifact.get("error"),
        "started_at": artifact.get("started_at"),
        "finished_at": artifact.get("finished_at"),
        "layout": layout,
        "build": artifact.get("build"),
        "hardware": artifact.get("hardware"),
        "torch": artifact.get("torch"),
        "engine_args": (artifact.get("config") or {}).get("engine_args"),
        "kvwarm": meta,
        "batch_semantics": "per_rank",
        "synchronization": exchange or None,
        "unfilled": dict(sorted(unfilled.items())),
    }
    return out
