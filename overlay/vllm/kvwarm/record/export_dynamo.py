"""A sweep as Dynamo's self-benchmark artifact: one file per data-parallel rank and kind of
point, every envelope field Dynamo 1.6.1's self-benchmark writes (schema_version 2,
artifact_type "rank"), each holding what it holds there (docs/export.md, field by field).

What is ours and has no field of theirs goes into `kvwarm_sweep` blocks (at the top, in each
result and in each skipped point): every timed sample, the phases, our own stamps per rank,
the run record, and `unfilled`, the paths of Dynamo's fields this sweep's record cannot fill
(written null) with why. Our stamps also go into the point's `sample_reasons`.

Plain data: nothing here imports vLLM.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from datetime import datetime
from pathlib import Path

from . import vocabulary as v
from .artifact import point_key

SCHEMA_VERSION = 2  # Dynamo's artifact, not ours
ARTIFACT_TYPE = "rank"
NAMESPACE = "kvwarm_sweep"
FPM_VERSION = 1
EXPLICIT = "explicit"  # Dynamo's stamp of a point from a points manifest: every point of ours
# How a result's wall_time was measured (Dynamo's: "steady_state_second_step" / "single_step").
MEASUREMENT_POLICY = {
    v.DECODE: "kvwarm_upper_median_of_steady_steps",
    v.PREFILL: "kvwarm_upper_median_of_measured_shots",
}
SYNTHETIC_PROMPTS = "kvwarm_salted_sequence"  # fake-KV prompts: a salted arithmetic sequence
UNSTAMPED = "unstamped"  # Dynamo's regime of a decode point that carries no stamp
# vLLM's CUDAGraphMode names: the mode of mixed (prefill) batches and of uniform decode batches
GRAPH_MODES = {
    "NONE": ("NONE", "NONE"),
    "PIECEWISE": ("PIECEWISE", "PIECEWISE"),
    "FULL": ("FULL", "FULL"),
    "FULL_DECODE_ONLY": ("NONE", "FULL"),
    "FULL_AND_PIECEWISE": ("PIECEWISE", "FULL"),
}
NOT_RECORDED = "not in the sweep's record"
TIME_RESOLUTION = 1.0  # seconds: a sweep record's started_at / finished_at
NOT_DYNAMO = "not applicable: the file was exported from a kvwarm sweep, not written by Dynamo"


def resolved_args(artifact: dict) -> dict:
    args = (artifact.get("config") or {}).get("engine_args")
    resolved = args.get("resolved") if isinstance(args, dict) else None
    return resolved if isinstance(resolved, dict) else {}


def _layout(artifact: dict, rank: int, size: int) -> dict:
    return {
        "data_parallel_size": size,
        "data_parallel_rank": rank,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "expert_parallel": False,
        **{k: val for k, val in (artifact.get("layout") or {}).items() if val is not None},
    }


def _time(stamp) -> datetime | None:
    try:
        return datetime.fromisoformat(stamp)
    except (TypeError, ValueError):
        return None


def _sha256(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _graph_modes(resolved: dict) -> tuple[str, str, str] | None:
    """(mode, prefill mode, decode mode) of the engine, None where the record lacks it."""
    if resolved.get("enforce_eager"):
        return "NONE", "NONE", "NONE"
    raw = resolved.get("cudagraph_mode")
    if raw is None:
        return None
    name = str(raw).rsplit(".", 1)[-1].upper()
    return (name, *GRAPH_MODES.get(name, (name, name)))


def _capture_sizes(resolved: dict, modes) -> tuple[list[int], list[int], list[int]]:
    """All, prefill and decode capture sizes, as Dynamo lists them."""
    sizes = sorted({int(s) for s in resolved.get("cudagraph_capture_sizes") or [] if int(s) > 0})
    if modes is None:
        return sizes, [], []
    prefill = list(sizes) if modes[1] != "NONE" else []
    seqs = resolved.get("max_num_seqs")
    decode = [s for s in sizes if seqs is None or s <= seqs] if modes[2] != "NONE" else []
    return sizes, prefill, decode


def _expected_graph(row: dict, kind: str, resolved: dict) -> dict:
    """The graph a point's steps should run in: the row's own record where it has one, else
    derived from the engine's resolved graph settings."""
    graph = row.get("graph")
    if isinstance(graph, dict) and "expected_cudagraph_mode" in graph:
        return {
            "mode": graph.get("expected_cudagraph_mode"),
            "capture": graph.get("expected_capture_size"),
            "padding": graph.get("padding_tokens"),
            "reasons": list(graph.get("reasons") or []),
        }
    point = row["point"]
    modes = _graph_modes(resolved)
    if modes is None:
        return {"mode": None, "capture": None, "padding": None, "reasons": []}
    n = point["batch_size"] if kind == v.DECODE else point.get("total_prefill_tokens", 0)
    limit = resolved.get("max_num_seqs" if kind == v.DECODE else "max_num_batched_tokens")
    tail = [v.ENGINE_LIMIT] if n == limit else []
    _, prefill, decode = _capture_sizes(resolved, modes)
    sizes, mode = (decode, modes[2]) if kind == v.DECODE else (prefill, modes[1])
    if mode == "NONE" or not sizes:
        return {"mode": "NONE", "capture": None, "padding": None, "reasons": [v.CUDAGRAPH_DISABLED, *tail]}
    capture = min((s for s in sizes if s >= n), default=None)
    if capture is None:
        return {"mode": "NONE", "capture": None, "padding": None, "reasons": [v.EAGER_TAIL, *tail]}
    reason = [v.CAPTURE] if capture == n else [v.POST_CAPTURE] if n - 1 in sizes else []
    return {"mode": mode, "capture": capture, "padding": capture - n, "reasons": [*reason, *tail]}


def _balanced(total: int, parts: int) -> list[int]:
    base, longer = divmod(total, parts)
    return [base + 1] * longer + [base] * (parts - longer)


def _variance(values: list[int]) -> float:
    return float(statistics.pvariance(values)) if len(values) > 1 else 0.0


def _fpm(point: dict, rank: int, benchmark_id: int, row: dict) -> dict:
    """One ForwardPassMetrics (Dynamo's msgspec struct, every count a JSON integer): the
    point's scheduled requests and the row's median as wall_time."""
    b, k = point["batch_size"], point["total_kv_read_tokens"]
    if point["point_type"] == v.PREFILL:
        n = point["total_prefill_tokens"]
        lengths = [a + c for a, c in zip(_balanced(n, b), _balanced(k, b))]
        scheduled = {
            "num_prefill_requests": b,
            "sum_prefill_tokens": n,
            "var_prefill_length": _variance(lengths),
            "sum_prefill_kv_tokens": k,
            "num_decode_requests": 0,
            "sum_decode_kv_tokens": 0,
            "var_decode_kv_tokens": 0.0,
        }
    else:
        scheduled = {
            "num_prefill_requests": 0,
            "sum_prefill_tokens": 0,
            "var_prefill_length": 0.0,
            "sum_prefill_kv_tokens": 0,
            "num_decode_requests": b,
            "sum_decode_kv_tokens": k,
            "var_decode_kv_tokens": _variance(_balanced(k, b)),
        }
    fpm = {
        "version": FPM_VERSION,
        "worker_id": "",
        "dp_rank": rank,
        "counter_id": benchmark_id,
        "wall_time": float(median(row)),
        "scheduled_requests": scheduled,
        "queued_requests": {
            "num_prefill_requests": 0,
            "sum_prefill_tokens": 0,
            "var_prefill_length": 0.0,
            "num_decode_requests": 0,
            "sum_decode_kv_tokens": 0,
            "var_decode_kv_tokens": 0.0,
        },
    }
    if point["point_type"] == v.DECODE:  # as Dynamo's warm-up marks its decode samples
        steps = len(row.get("steady_seconds") or [])
        if steps > 1:
            fpm["kvwarm_giant_median_of"] = steps
        fpm["kvwarm_steady_sample"] = True
    return fpm


def median(row: dict) -> float:
    median = row.get("median_seconds")
    return median if isinstance(median, (int, float)) else statistics.median_high(row["steady_seconds"])


def _row_extras(row: dict, size: int) -> dict:
    steps = list(row.get("steady_seconds") or [])
    return {
        "kv_seed_regime": row["kv_seed_regime"],
        "sample_reasons": list(row.get("sample_reasons") or []),
        "steady_seconds": steps,
        "median_seconds": median(row),
        "min_seconds": row.get("min_seconds", min(steps)),
        "max_seconds": row.get("max_seconds", max(steps)),
        "spread": row.get("spread", (max(steps) - min(steps)) / median(row) if median(row) else 0.0),
        "median_of": len(steps),
        "phases": row.get("phases"),
        "graph": row.get("graph"),
        "global_batch_size": row.get("global_batch_size", row["point"]["batch_size"] * size),
    }


def _skipped_regime(kind: str) -> str:
    """Dynamo's regime of a point that never ran: its skip entries carry no stamp."""
    return UNSTAMPED if kind == v.DECODE else v.NOT_APPLICABLE


def grid(sweep, kind: str):
    """The kind's points over every rank: those measured on every rank (in rank 0's order),
    those skipped on some rank (with the first skipping rank's entry), and how many points
    the ranks recorded in all."""
    measured = [
        {point_key(r["point"]): r for r in a.get("results", []) if point_key(r["point"])[0] == kind}
        for a in sweep.ranks
    ]
    skipped: dict[tuple, dict] = {}
    for artifact in sweep.ranks:
        for entry in artifact.get("skipped_points", []):
            key = point_key(entry["point"])
            if key[0] == kind:
                skipped.setdefault(key, entry)
    everywhere = [key for key in measured[0] if all(key in m for m in measured[1:]) and key not in skipped]
    seen = set(skipped) | {key for m in measured for key in m}
    return everywhere, measured, skipped, len(seen)


def _point(key: tuple, benchmark_id: int, reasons: list[str], graph: dict) -> dict:
    kind, k, b, n = key
    return {
        "point_type": kind,
        "benchmark_id": benchmark_id,
        "total_prefill_tokens": n,
        "total_kv_read_tokens": k,
        "batch_size": b,
        "expected_cudagraph_mode": graph["mode"],
        "expected_capture_size": graph["capture"],
        "padding_tokens": graph["padding"],
        "sample_reasons": reasons,
        "partition": None,
        "rows": None,
    }


def _stamps(rows: list[dict]) -> list[str]:
    """Every rank's stamps, once each, in rank order: the point is the same on every rank."""
    out: list[str] = []
    for row in rows:
        out += [s for s in row.get("sample_reasons") or [] if s not in out]
    return out


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
        "kvwarm_eligible": kind == v.DECODE
        and all((a.get("kvwarm") or {}).get("warm_eligible") is True for a in sweep.ranks),
    }


def _block_size(resolved: dict) -> int | None:
    sizes = resolved.get("block_sizes")
    if not isinstance(sizes, dict) or not sizes:
        return None
    attention = [s for name, s in sizes.items() if "Attention" in name]
    return max(attention or sizes.values())


def _engine(artifact: dict, layout: dict, resolved: dict, modes, unfilled: dict) -> dict:
    """Dynamo's engine provenance, from what the sweep's record holds; the rest null (listed
    in `unfilled`)."""
    dtype = resolved.get("dtype")
    kv_dtype = resolved.get("kv_cache_dtype")
    groups = []
    for i, (name, size) in enumerate((resolved.get("block_sizes") or {}).items()):
        groups.append(
            {
                "type": name.split(":", 1)[-1],
                "dtype": dtype if kv_dtype in (None, "auto") else kv_dtype,
                "head_size": None,
                "num_kv_heads": None,
                "block_size": size,
                "kv_quant_mode": None,
                "sliding_window": None,
                "attention_chunk_size": None,
                "non_causal": None,
            }
        )
        for key in ("head_size", "num_kv_heads", "kv_quant_mode", "sliding_window", "attention_chunk_size"):
            unfilled[f"engine.kv_cache.groups[{i}].{key}"] = NOT_RECORDED
        unfilled[f"engine.kv_cache.groups[{i}].non_causal"] = NOT_RECORDED
    build = artifact.get("build") or {}
    engine = {
        "attention": {
            "backend_requested": None,
            "backend_per_kind": {},
            "mla_prefill_backend_requested": None,
            "flash_attn_version": None,
            "use_trtllm_attention": None,
            "indexer_kv_dtype": None,
            "indexer_kv_dtype_configured": None,
            "backend_resolved": None,
            "mla_prefill_backend_resolved": None,
            "resolution": "not_recorded",
        },
        "kv_cache": {
            "cache_dtype": kv_dtype,
            "block_size": _block_size(resolved),
            "enable_prefix_caching": resolved.get("enable_prefix_caching"),
            "groups": groups,
            "kv_cache_layout": None,
        },
        "quantization": {"method": None, "checkpoint_config": None, "quant_config_class": None},
        "scheduler": {
            "max_num_batched_tokens": resolved.get("max_num_batched_tokens"),
            "max_num_seqs": resolved.get("max_num_seqs"),
            "async_scheduling": resolved.get("async_scheduling"),
            "enable_chunked_prefill": resolved.get("enable_chunked_prefill"),
            "long_prefill_token_threshold": resolved.get("long_prefill_token_threshold"),
        },
        "model": {
            "dtype": dtype,
            "model_type": resolved.get("model_type"),
            "architectures": resolved.get("architectures"),
            "model": (artifact.get("config") or {}).get("model"),
        },
        "parallel": {
            "data_parallel_size": layout["data_parallel_size"],
            "data_parallel_rank": layout["data_parallel_rank"],
            "tensor_parallel_size": layout["tensor_parallel_size"],
            "pipeline_parallel_size": layout["pipeline_parallel_size"],
            "prefill_context_parallel_size": None,
            "decode_context_parallel_size": None,
            "enable_expert_parallel": layout["expert_parallel"],
            "enable_eplb": None,
            "all2all_backend": None,
            "eplb_config": None,
        },
        "speculative": None,
        "graph": {
            "cudagraph_mode": None if modes is None else modes[0],
            "cudagraph_capture_sizes": _capture_sizes(resolved, modes)[0],
            "resolution": "resolved_by_vllm",
        },
        "versions": {
            "vllm": build.get("version"),
            "vllm_build_commit": None,
            "dynamo": None,
            "python": (artifact.get("hardware") or {}).get("python"),
        },
        "resolved": None,
        "resolution": "kvwarm_sweep_record",
    }
    for path in (
        "attention.indexer_kv_dtype_configured",
        "kv_cache.kv_cache_layout",
        "quantization.method",
        "quantization.checkpoint_config",
        "quantization.quant_config_class",
        "parallel.prefill_context_parallel_size",
        "parallel.decode_context_parallel_size",
        "parallel.enable_eplb",
        "parallel.all2all_backend",
        "parallel.eplb_config",
        "speculative",
        "versions.vllm_build_commit",
    ):
        unfilled[f"engine.{path}"] = NOT_RECORDED
    unfilled["engine.versions.dynamo"] = NOT_DYNAMO
    _mark_nulls(engine, "engine", unfilled)
    return engine


def _mark_nulls(block: dict, prefix: str, unfilled: dict) -> None:
    """Every other null a record gap left in `block` (a missing resolved argument)."""
    for key, value in block.items():
        path = f"{prefix}.{key}"
        if isinstance(value, dict):
            _mark_nulls(value, path, unfilled)
        elif value is None and not any(p == path or p.startswith(path + ".") for p in unfilled):
            if path in NULL_IN_DYNAMO:
                continue
            unfilled[path] = NOT_RECORDED


# Fields Dynamo itself writes null where nothing applies (not a gap of our record).
NULL_IN_DYNAMO = {
    "engine.attention.backend_requested",
    "engine.attention.mla_prefill_backend_requested",
    "engine.attention.flash_attn_version",
    "engine.attention.use_trtllm_attention",
    "engine.attention.indexer_kv_dtype",
    "engine.attention.backend_resolved",
    "engine.attention.mla_prefill_backend_resolved",
    "engine.resolved",
    "kvwarm.skip_reason",  # null: the gate admitted the model
    "kvwarm.dataset",  # null: no dataset read (warm-up off)
}


def rank_artifacts(sweep, kind: str, paths: list[Path]) -> list[dict]:
    """Dynamo's rank artifact of every rank for one kind of point (config.mode = kind);
    `paths`: where each rank's file goes (its config.output_path)."""
    size = sweep.size
    everywhere, measured, skipped, expected = grid(sweep, kind)
    resolved0 = resolved_args(sweep.ranks[0])
    points = {}
    for i, key in enumerate(everywhere, start=1):
        rows = [m[key] for m in measured]
        graph = _expected_graph(rows[0], kind, resolved0)
        points[key] = _point(key, i, [EXPLICIT, *graph["reasons"], *_stamps(rows)], graph)
    skipped_points = []
    for i, (key, entry) in enumerate(skipped.items(), start=len(everywhere) + 1):
        graph = _expected_graph(entry, kind, resolved0)
        skipped_points.append(
            {
                "point": _point(key, i, [EXPLICIT, *graph["reasons"]], graph),
                "kv_seed_regime": _skipped_regime(kind),
                "reason": entry["kv_seed_regime"].removeprefix(v.SKIP_PREFIX),
                NAMESPACE: {"kv_seed_regime": entry["kv_seed_regime"], "reason": entry.get("reason", "")},
            }
        )
    fpms = {
        key: [_fpm(points[key], r, points[key]["benchmark_id"], m[key]) for r, m in enumerate(measured)]
        for key in everywhere
    }
    groups = [
        {
            "benchmark_id": points[key]["benchmark_id"],
            "point": points[key],
            "expected_dp_ranks": list(range(size)),
            "complete": True,
            "wall_time": max(f["wall_time"] for f in fpms[key]),
            "rank_results": [{"dp_rank": r, "fpms": [fpms[key][r]]} for r in range(size)],
        }
        for key in everywhere
    ]
    measured_seconds = sum(g["wall_time"] for g in groups)
    # every timed sample of the sweep (all kinds), the slowest rank's at each point: a floor
    # for every rank's elapsed time, since the ranks meet at each point's start
    per_point: dict[tuple, float] = {}
    for artifact in sweep.ranks:
        for row in artifact.get("results", []):
            key = point_key(row["point"])
            per_point[key] = max(per_point.get(key, 0.0), sum(row.get("steady_seconds") or []))
    floor = max(sum(per_point.values()), measured_seconds)
    return [
        _rank_artifact(sweep, r, kind, paths[r], points, everywhere, measured[r], fpms, groups, skipped_points)
        | _timing_fields(
            sweep.ranks[r], kind, measured_seconds, floor, expected, len(everywhere), groups, skipped_points
        )
        for r in range(size)
    ]


def _timing_fields(artifact, kind, measured_seconds, floor, expected, completed, groups, skipped) -> dict:
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
    missing = [] if expected else [kind]
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


def _rank_artifact(sweep, rank, kind, path, points, everywhere, measured, fpms, groups, skipped) -> dict:
    artifact = sweep.ranks[rank]
    size = sweep.size
    resolved = resolved_args(artifact)
    layout = _layout(artifact, rank, size)
    meta = artifact.get("kvwarm") or {}
    modes = _graph_modes(resolved)
    sizes, prefill_sizes, decode_sizes = _capture_sizes(resolved, modes)
    unfilled: dict[str, str] = {}
    results = [
        {
            "point": points[key],
            "kv_seed_regime": measured[key]["kv_seed_regime"],
            "fpms": [fpms[key][rank]],
            NAMESPACE: _row_extras(measured[key], size),
        }
        for key in everywhere
    ]
    seqs, tokens = resolved.get("max_num_seqs"), resolved.get("max_num_batched_tokens")
    blocks = resolved.get("num_gpu_blocks")
    feasible = 0
    if kind == v.DECODE:
        known = [x for x in (seqs, tokens, None if blocks is None else blocks - 1) if isinstance(x, int)]
        feasible = max(0, min(known)) if len(known) == 3 else None
    out = {"schema_version": SCHEMA_VERSION}
    if kind == v.DECODE:  # Dynamo writes its warm-up's block in decode (and agg) runs only
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
        "grid_digest": _sha256([points[k] for k in everywhere] + [s["point"] for s in skipped]),
        "timing": None,
        "dp": {"rank": rank, "size": size},
        "synchronization": {"enabled": size > 1, "coordinator_rank": 0, "port": None},
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
            "block_size": _block_size(resolved),
            "num_gpu_blocks": blocks,
            "configured_max_batch_size": seqs,
            "feasible_max_batch_size": feasible,
        },
        "recurrent_state": {"initialization": "unchanged", "policy": None, "uniform_bound": None},
        "measurement_policy": dict(MEASUREMENT_POLICY),
        "synthetic_prompts": {"mode": SYNTHETIC_PROMPTS, "vocab_size": None},
        "capacity": {"common": _capacity(sweep, kind)},
        "cudagraph": {
            "mode": None if modes is None else modes[0],
            "prefill_mode": None if modes is None else modes[1],
            "decode_mode": None if modes is None else modes[2],
            "max_capture_size": sizes[-1] if sizes else 0,
            "capture_sizes": sizes,
            "prefill_capture_sizes": prefill_sizes,
            "decode_capture_sizes": decode_sizes,
        },
        "engine": _engine(artifact, layout, resolved, modes, unfilled),
        "results": results,
        "iteration_groups": groups,
        "skipped_points": skipped,
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
        "synchronization.port": "the ranks meet through files in the output folder, not a TCP port",
    }
    unfilled |= {path: why for path, why in gaps.items() if path != "synchronization.port" or size > 1}
    for block in ("kvwarm", "limits", "capacity", "cudagraph"):
        if block not in out:
            continue
        _mark_nulls(out[block], block, unfilled)
    out[NAMESPACE] = {
        "exported_from": str(sweep.paths[rank]),
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
        "synchronization": "files" if size > 1 else None,
        "unfilled": dict(sorted(unfilled.items())),
    }
    return out
