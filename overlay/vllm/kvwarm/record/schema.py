"""The JSON schema of sweep.json (one rank's artifact, or the combined view of every DP rank),
built from the vocabulary so that the words it allows are the ones the writers use.

Readers accept every schema_version they know and ignore fields they do not; fields are only
added within a version, a rename or removal bumps it.
"""

from __future__ import annotations

import functools

from . import vocabulary as v

NULLABLE_STRING = {"type": ["string", "null"]}
COUNT = {"type": "integer", "minimum": 0}
POSITIVE = {"type": "integer", "minimum": 1}
SECONDS = {"type": "number", "minimum": 0}


def _object(required: dict, optional: dict | None = None) -> dict:
    return {"type": "object", "required": list(required), "properties": {**required, **(optional or {})}}


PART = {"type": "object", "properties": {"total_kv_read_tokens": COUNT, "batch_size": POSITIVE}}
POINT = _object(
    {"total_kv_read_tokens": COUNT, "batch_size": POSITIVE},
    {
        "point_type": {"enum": list(v.ROW_POINT_TYPES)},
        "total_prefill_tokens": COUNT,
        "continuation": {"type": "boolean"},  # a prefill row's requests were running ones
        # a mixed point's parts (its totals are the step's)
        "decode": {**PART, "required": ["total_kv_read_tokens", "batch_size"]},
        "prefill": {
            **PART,
            "required": ["total_prefill_tokens", "total_kv_read_tokens", "batch_size"],
            "properties": {**PART["properties"], "total_prefill_tokens": POSITIVE, "continuation": {"type": "boolean"}},
        },
    },
)
NULLABLE_SECONDS = {"type": ["number", "null"], "minimum": 0}
PHASES = {
    "type": ["object", "null"],
    "properties": {p: NULLABLE_SECONDS for p in v.PHASES},
    "additionalProperties": False,
}
GRAPH = {
    "type": ["object", "null"],
    "properties": {
        "expected_cudagraph_mode": NULLABLE_STRING,
        "expected_capture_size": {"type": ["integer", "null"]},
        "padding_tokens": {"type": ["integer", "null"], "minimum": 0},
        "reasons": {"type": "array", "items": {"enum": list(v.GRAPH_REASONS)}},
        "observed_cudagraph_mode": NULLABLE_STRING,
        "observed_size": {"type": ["integer", "null"]},
        # per timed sample [mode, padded tokens] as the runner reported it (null: it reported
        # none, and `why` says why)
        "observed": {"type": ["array", "null"], "items": {"type": ["array", "null"]}},
        "why": NULLABLE_STRING,
    },
}
DATASET = _object(
    {
        "path": {"type": "string"},
        "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
        "collection_pool": {"type": "string"},
        "conversations": POSITIVE,
    }
)
KVWARM = _object(
    {
        "enabled": {"type": "boolean"},
        "warm_eligible": {"type": "boolean"},
        "skip_reason": NULLABLE_STRING,
        "points_real_kv": COUNT,
        "points_fake_fallback": COUNT,
        "giant_kv_repeats": POSITIVE,
        "state_mode_requested": NULLABLE_STRING,
        "state_mode": {"enum": [v.COPY, v.INPLACE, v.EXACT, None]},
        "reset_prefix_cache": {"type": ["boolean", "null"]},
        "dataset": {"oneOf": [{"type": "null"}, DATASET]},
        "stages": {"type": "array", "items": _object({"batch": POSITIVE, "depth": POSITIVE, "build_seconds": SECONDS})},
        "giant_kv_threshold": {"type": ["integer", "null"], "minimum": 0},
    },
    {
        "noisy_spread": {"type": ["number", "null"], "minimum": 0},
        "settle_steps": COUNT,
        "gc": {
            "type": ["object", "null"],
            "required": ["policy"],
            "properties": {
                "policy": {"enum": ["held", "engine"]},
                "collections_between_points": COUNT,
                "heap_at_end": {"enum": ["unfrozen", "refrozen", None]},
                "workers": {"type": "object", "required": ["policy"]},
            },
        },
        "engine_loop": {
            "type": ["object", "null"],
            "required": ["loop", "scheduler_cls"],
            "properties": {
                "loop": {"enum": list(v.LOOPS)},
                "scheduler_cls": {"type": "string"},
                "async_scheduling": {"type": "boolean"},
                "batch_queue_size": POSITIVE,
            },
        },
        "plan": {"type": ["object", "null"]},
        "boots": {
            "type": ["array", "null"],
            "items": _object({"boot": COUNT, "started_at": {"type": "string"}, "rows": COUNT}),
        },
        "resume": {
            "type": ["object", "null"],
            "properties": {
                "replaced": {"type": "array", "items": _object({"point": POINT, "reason": {"type": "string"}})}
            },
        },
        "ab": {"type": ["object", "null"], "required": ["first"], "properties": {"first": {"enum": ["alternate"]}}},
        "exchange": {
            "type": ["object", "null"],
            "required": ["exchange", "address", "port"],
            "properties": {
                "exchange": {"enum": ["store", "files"]},
                "address": {"type": "string"},
                "port": {"type": ["integer", "null"], "minimum": 1, "maximum": 65535},
                "port_origin": NULLABLE_STRING,
            },
        },
    },
)
AB = {"ab": {"enum": list(v.AB_SIDES)}, "ab_first": {"type": "boolean"}}  # an A/B sweep's rows
RESULT = _object(
    {
        "point": POINT,
        "kv_seed_regime": {"enum": [*v.REGIMES, *v.PREFILL_REGIMES]},
        "sample_reasons": {"type": "array", "items": {"type": "string"}},
        "steady_seconds": {"type": "array", "items": SECONDS, "minItems": 1},
        "median_seconds": SECONDS,
        "global_batch_size": POSITIVE,
        "min_seconds": SECONDS,
        "max_seconds": SECONDS,
        "spread": SECONDS,
    },
    {
        "ranks": {"type": "array", "items": _object({"rank": COUNT, "median_seconds": SECONDS})},
        "phases": PHASES,
        "graph": GRAPH,
        "sample_kind": {"enum": list(v.SAMPLE_KINDS)},
        "split": _object(
            {
                "prefix_tokens": {"type": "array", "items": COUNT, "minItems": 1},
                "new_tokens": {"type": "array", "items": POSITIVE, "minItems": 1},
            }
        ),
        **AB,
    },
)
SKIPPED = _object(
    {
        "point": POINT,
        "kv_seed_regime": {"type": "string", "pattern": f"^{v.SKIP_PREFIX}"},
        "reason": {"type": "string"},
    },
    AB,
)
# an A/B sweep's fake side: its rows, as the artifact's own
AB_FAKE_SIDE = _object(
    {"results": {"type": "array", "items": RESULT}, "skipped_points": {"type": "array", "items": SKIPPED}}
)
LAYOUT = _object(
    {
        "data_parallel_size": POSITIVE,
        "data_parallel_rank": {"type": ["integer", "null"], "minimum": 0},
        "tensor_parallel_size": POSITIVE,
        "pipeline_parallel_size": POSITIVE,
        "expert_parallel": {"type": "boolean"},
    }
)
HARDWARE = {
    "type": ["object", "null"],
    "properties": {
        "cpu": {"type": "string"},
        "cores": {"type": ["integer", "null"]},
        "gpus": {"type": "array"},
        "driver": NULLABLE_STRING,
        "cuda_runtime": NULLABLE_STRING,
        "transparent_hugepages": NULLABLE_STRING,
    },
}
RANK_SUMMARY = _object(
    {
        "rank": COUNT,
        "status": {"enum": list(v.STATUSES)},
        "rows": COUNT,
        "error": NULLABLE_STRING,
        "path": {"type": "string"},
    }
)

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "kvwarm sweep artifact (one rank's, or the combined view of every DP rank)",
    **_object(
        {
            "schema_version": {"const": v.SCHEMA_VERSION},
            "artifact_type": {"enum": [v.RANK, v.COMBINED]},
            "status": {"enum": list(v.STATUSES)},
            "error": NULLABLE_STRING,
            "started_at": {"type": "string"},
            "finished_at": NULLABLE_STRING,
            "config": {"type": "object", "properties": {"engine_args": {"type": "object"}}},
            "build": {"type": ["object", "null"]},
            "layout": LAYOUT,
            "hardware": HARDWARE,
            "torch": NULLABLE_STRING,
            "kvwarm": KVWARM,
            "results": {"type": "array", "items": RESULT},
            "skipped_points": {"type": "array", "items": SKIPPED},
        },
        {"ranks": {"type": "array", "items": RANK_SUMMARY}, v.AB_FAKE_SIDE: AB_FAKE_SIDE},
    ),
}


@functools.cache
def _validator():
    # The schema is checked once: jsonschema.validate would check it again on every write
    # (the sweep writes its artifact after every point).
    import jsonschema

    cls = jsonschema.validators.validator_for(SCHEMA)
    cls.check_schema(SCHEMA)
    return cls(SCHEMA)


def validate(artifact: dict) -> None:
    """Raises jsonschema's ValidationError where the artifact does not fit (a writer's bug)."""
    import jsonschema

    error = jsonschema.exceptions.best_match(_validator().iter_errors(artifact))
    if error is not None:
        raise error
