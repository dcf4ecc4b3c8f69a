"""The engine's provenance in Dynamo's self-benchmark artifact (its `engine` and `cudagraph`
blocks), from what a sweep's record holds, and the bookkeeping of the fields the record cannot
fill: each is written null and listed in `unfilled` with why (`mark_nulls`), except those
Dynamo itself writes null (NULL_IN_DYNAMO).

The engine's CUDA graphs are what the sweep recorded (`kvwarm.cudagraph`: vLLM's own
`decode_mode()` and `mixed_mode()`); a record that predates that block has them derived from
its resolved engine arguments (`recorded_graphs`).

Plain data: nothing here imports vLLM.
"""

from __future__ import annotations

from ..shape import NONE, GraphConfig, split_of

NOT_RECORDED = "not in the sweep's record"
NOT_DYNAMO = "not applicable: the file was exported from a kvwarm sweep, not written by Dynamo"
# vLLM's CUDAGraphMode names: the mode of mixed (prefill) batches and of uniform decode batches
# each mode gives, for a record without the sweep's own `kvwarm.cudagraph` (an older sweep's)
OLDER_RECORD_MODES = {
    "NONE": ("NONE", "NONE"),
    "PIECEWISE": ("PIECEWISE", "PIECEWISE"),
    "FULL": ("FULL", "FULL"),
    "FULL_DECODE_ONLY": ("NONE", "FULL"),
    "FULL_AND_PIECEWISE": ("PIECEWISE", "FULL"),
}


def resolved_args(artifact: dict) -> dict:
    args = (artifact.get("config") or {}).get("engine_args")
    resolved = args.get("resolved") if isinstance(args, dict) else None
    return resolved if isinstance(resolved, dict) else {}


def engine_layout(artifact: dict, rank: int, size: int) -> dict:
    """The rank's parallel layout: the record's, where it holds one."""
    return {
        "data_parallel_size": size,
        "data_parallel_rank": rank,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "expert_parallel": False,
        **{k: val for k, val in (artifact.get("layout") or {}).items() if val is not None},
    }


def block_size(resolved: dict) -> int | None:
    sizes = resolved.get("block_sizes")
    if not isinstance(sizes, dict) or not sizes:
        return None
    attention = [s for name, s in sizes.items() if "Attention" in name]
    return max(attention or sizes.values())


def recorded_graphs(artifact: dict) -> GraphConfig | None:
    """The engine's CUDA graphs as the sweep recorded them, None where the record lacks the
    modes (no `kvwarm.cudagraph`, and neither enforce_eager nor cudagraph_mode resolved)."""
    resolved = resolved_args(artifact)
    seqs, tokens = resolved.get("max_num_seqs"), resolved.get("max_num_batched_tokens")
    block = (artifact.get("kvwarm") or {}).get("cudagraph")
    if isinstance(block, dict) and block.get("mode") is not None:
        return GraphConfig(
            mode=block["mode"],
            decode_mode=block.get("decode_mode") or NONE,
            prefill_mode=block.get("prefill_mode") or NONE,
            capture_sizes=tuple(block.get("capture_sizes") or ()),
            decode_capture_sizes=tuple(block.get("decode_capture_sizes") or ()),
            prefill_capture_sizes=tuple(block.get("prefill_capture_sizes") or ()),
            max_num_seqs=seqs,
            max_num_batched_tokens=tokens,
        )
    sizes, split = resolved.get("cudagraph_capture_sizes"), split_of(resolved, dict.get)
    if resolved.get("enforce_eager"):
        return GraphConfig.of(NONE, NONE, NONE, sizes, seqs, tokens, split)
    raw = resolved.get("cudagraph_mode")
    if raw is None:
        return None
    name = str(raw).rsplit(".", 1)[-1].upper()
    prefill, decode = OLDER_RECORD_MODES.get(name, (name, name))
    return GraphConfig.of(name, decode, prefill, sizes, seqs, tokens, split)


def cudagraph_block(artifact: dict) -> dict:
    """Dynamo's `cudagraph` block; without recorded modes, null modes and no per-kind sizes."""
    graphs = recorded_graphs(artifact)
    shown = graphs or GraphConfig.of(NONE, NONE, NONE, resolved_args(artifact).get("cudagraph_capture_sizes"), 0, 0)
    return {
        "mode": None if graphs is None else graphs.mode,
        "prefill_mode": None if graphs is None else graphs.prefill_mode,
        "decode_mode": None if graphs is None else graphs.decode_mode,
        "max_capture_size": shown.capture_sizes[-1] if shown.capture_sizes else 0,
        "capture_sizes": list(shown.capture_sizes),
        "prefill_capture_sizes": list(shown.prefill_capture_sizes),
        "decode_capture_sizes": list(shown.decode_capture_sizes),
    }


def engine_provenance(artifact: dict, layout: dict, resolved: dict, cudagraph: dict, unfilled: dict) -> dict:
    """Dynamo's engine provenance, from what the sweep's record holds; the rest null (listed
    in `unfilled`); `cudagraph`: the rank's `cudagraph` block."""
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
    parallel = resolved.get("parallel") if isinstance(resolved.get("parallel"), dict) else {}
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
            "block_size": block_size(resolved),
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
            "prefill_context_parallel_size": parallel.get("prefill_context_parallel_size"),
            "decode_context_parallel_size": parallel.get("decode_context_parallel_size"),
            "enable_expert_parallel": layout["expert_parallel"],
            "enable_eplb": parallel.get("enable_eplb"),
            "all2all_backend": parallel.get("all2all_backend"),
            "eplb_config": parallel.get("eplb_config"),
        },
        "speculative": None,
        "graph": {
            "cudagraph_mode": cudagraph["mode"],
            "cudagraph_capture_sizes": list(cudagraph["capture_sizes"]),
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
        "speculative",
        "versions.vllm_build_commit",
    ):
        unfilled[f"engine.{path}"] = NOT_RECORDED
    unfilled["engine.versions.dynamo"] = NOT_DYNAMO
    mark_nulls(engine, "engine", unfilled)
    return engine


def mark_nulls(block: dict, prefix: str, unfilled: dict) -> None:
    """Every other null a record gap left in `block` (a missing resolved argument)."""
    for key, value in block.items():
        path = f"{prefix}.{key}"
        if isinstance(value, dict):
            mark_nulls(value, path, unfilled)
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
    "engine.parallel.eplb_config.communicator",  # vLLM's own default
    "kvwarm.skip_reason",  # null: the gate admitted the model
    "kvwarm.dataset",  # null: no dataset read (warm-up off)
}
