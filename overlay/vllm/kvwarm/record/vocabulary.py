"""The words of the measurement record, spelled once: every writer and reader imports them.

Plain data, no vLLM. The strings are the compatible surface (existing collectors read them):
never rename one; add new words here.
"""

from __future__ import annotations

from datetime import datetime

# --- the artifact --------------------------------------------------------------------------
SCHEMA_VERSION = 3
ARTIFACT = "sweep.json"
ARTIFACT_CSV = "sweep.csv"
ARTIFACT_PNG = "sweep.png"
ROWS = "rows.jsonl"  # a rank's rows as they are measured, beside its sweep.json (record.row_log)
# artifact_type: our own tags (schema 3 on); schema 1 and 2 said "rank" / "combined", which
# is also the tag of Dynamo's self-benchmark artifact, a file of another shape.
RANK, COMBINED = "kvwarm.rank", "kvwarm.combined"
OLD_ARTIFACT_TYPES = {"rank": RANK, "combined": COMBINED}
RUNNING, COMPLETE, FAILED = "running", "complete", "failed"  # status
STATUSES = (RUNNING, COMPLETE, FAILED)

# --- a point's kind (point.point_type) --------------------------------------------------------
DECODE, PREFILL = "decode", "prefill"
POINT_TYPES = (DECODE, PREFILL)  # the plain kinds, which the tables, reports and exports read
# a step of decodes and a prefill part at once; its point also holds its parts (record.artifact)
MIXED = "mixed"
ROW_POINT_TYPES = (*POINT_TYPES, MIXED)

# --- the phases of a timed step (a row's `phases`: the median of each over its timed steps) ---
# schedule: vLLM's own schedule(); forward: from its end to update_from_output (the executor:
# model and sampler); update: update_from_output; sweep: what the sweep and the adapter did in
# the step; other: the rest of the step's wall time (the engine loop, output processing).
PHASES = ("schedule", "forward", "update", "sweep", "other")

# --- the engine loop a sweep ran under (kvwarm.engine_loop.loop) -----------------------------
LOOP_SYNC = "sync"  # EngineCore.step: schedule, forward, update, one step at a time
LOOP_BATCH_QUEUE = "batch_queue"  # EngineCore.step_with_batch_queue (async scheduling)
LOOPS = (LOOP_SYNC, LOOP_BATCH_QUEUE)

# --- sample_kind: what one of a row's timed samples (its steady_seconds) is ------------------
STEP = "step"  # a whole step window, from one update's end to the next (decode)
SHOT_FORWARD = "shot_forward"  # a prefill shot's forward: from the end of its schedule() to its output
SAMPLE_KINDS = (STEP, SHOT_FORWARD)
SAMPLE_KIND_OF = {DECODE: STEP, PREFILL: SHOT_FORWARD, MIXED: SHOT_FORWARD}  # mixed: timed as its prefill shot

# --- kv_seed_regime: what the KV a row's steps read was ------------------------------------
REAL_KV = "real_kv"  # borrowed from chains of real text
FAKE_FALLBACK = "fake_fallback"  # warm-up on, but no chain covers the point: fake KV
LEGACY = "legacy"  # warm-up off: every point on fake KV (the A/B baseline)
REGIMES = (REAL_KV, FAKE_FALLBACK, LEGACY)
# prefill points: what the prefix a step reads was
REAL_PREFIX = "real_prefix"  # a prefix-cache hit on chains of real text
FAKE_PREFIX = "fake_prefix"  # blocks registered and hashed, never computed
NOT_APPLICABLE = "not_applicable"  # no prefix (P = 0)
PREFILL_REGIMES = (REAL_PREFIX, FAKE_PREFIX, NOT_APPLICABLE)
SKIP_PREFIX = "skip:"  # a skipped point's regime is skip:<reason>

# --- real and fake KV in one boot (--ab): the side a row measured (a row's `ab`) -------------
# The real side's rows are the artifact's `results` and `skipped_points`, the table every
# reader takes; the fake side's (fake KV, regime legacy; fake prefixes) are the AB_FAKE_SIDE
# block's `results` and `skipped_points`.
AB_REAL, AB_FAKE = "real", "fake"
AB_SIDES = (AB_REAL, AB_FAKE)
AB_FAKE_SIDE = "ab_fake_side"


def skip_regime(reason: str) -> str:
    return f"{SKIP_PREFIX}{reason}"


def is_skipped(regime: str) -> bool:
    return regime.startswith(SKIP_PREFIX)


# --- sample_reasons: the stamps a row carries ------------------------------------------------
STAMP_REAL_KV = "kvwarm_real_kv"
STAMP_FAKE_FALLBACK = "kvwarm_fake_fallback"
NOISY = "kvwarm_noisy"  # the timed steps spread more than the artifact's noisy_spread
CONTEXT_CLAMPED = "context_clamped"  # 1-token contexts admitted at 1: the row has the measured K
# An in-place shadow advanced its chain's recurrent state: later points of the rung read
# the state of more tokens than the chain holds (docs/state-handoff.md).
STATE_DRIFTED = "kvwarm_state_drifted"
STAMP_PREFILL_REAL_SEED = "prefill_real_seed"
STAMP_PREFILL_FAKE_PREFIX = "prefill_fake_prefix"
# The graph the step ran (where the runner says) is not the one the row expects.
GRAPH_MISMATCH = "kvwarm_graph_mismatch"
STATE_STAMP_PREFIX = "kvwarm_state_"
STATE_DEPTH_STAMP = "kvwarm_state_depth="


def state_stamps(mode: str | None, depth: int) -> list[str]:
    """A point's state stamps: the mode and the depth of the deepest state its shadows read
    (copy, in place: the chain's whole depth; exact: the point's context). None: no stamps."""
    if mode is None:
        return []
    return [f"{STATE_STAMP_PREFIX}{mode}", f"{STATE_DEPTH_STAMP}{depth}"]


# --- state hand-off modes (DYN_BENCH_KV_WARMUP_STATE) ---------------------------------------
AUTO, COPY, INPLACE, EXACT = "auto", "copy", "inplace", "exact"
STATE_MODES = (AUTO, COPY, INPLACE, EXACT)

# --- the gate's reasons (skip_reason), in the order they are checked -------------------------
FLAG_OFF = "flag_off"
DENSE_MODEL = "dense_model_content_insensitive"
MOE_TP_BALANCED = "moe_tp_balanced_by_construction"
PREFIX_CACHING_DISABLED = "prefix_caching_disabled"
HYBRID_STATE_LAYERS_UNSUPPORTED = "hybrid_state_layers_unsupported"
STATE_MODE_INVALID = "state_mode_invalid"
STATE_COPY_UNSUPPORTED = "state_copy_unsupported"
STATE_INPLACE_UNSUPPORTED = "state_inplace_unsupported"
# In place where the build can fork: copy hands over the same state and steps as a natural
# request does, in place would time a lighter schedule() (docs/state-handoff.md).
STATE_INPLACE_UNFAITHFUL = "state_inplace_unfaithful"
STATE_EXACT_UNSUPPORTED = "state_exact_unsupported"
STATE_HAND_OFF_UNSUPPORTED = "state_hand_off_unsupported"
CONTENT_TOO_SHALLOW = "content_too_shallow"  # written "content_too_shallow: H < N"

# --- why a sweep is refused before it starts (its error names the reason) --------------------
# A timed step there would not be the shape its row says.
SPECULATIVE_DECODING_UNSUPPORTED = "speculative_decoding_unsupported"
PIPELINE_PARALLEL_UNSUPPORTED = "pipeline_parallel_unsupported"

# --- why a point was skipped (skip:<reason>) -------------------------------------------------
POINT_SKIP_REASON = "decode_injection_failed"  # a shadow (or fake request) could not be registered
BATCH_SIZE_MISMATCH = "measured_batch_size_mismatch"  # a timed step ran other than the point's B
PREFILL_TOKENS_MISMATCH = "measured_prefill_tokens_mismatch"  # the step computed other than N new tokens
KV_READ_MISMATCH = "measured_kv_read_mismatch"  # the prefix hit was not P tokens
PREFILL_INJECTION_FAILED = "prefill_injection_failed"
FAKE_PREFIX_ALLOCATION_FAILED = "fake_prefix_cache_allocation_failed"
FAKE_PREFIX_VALIDATION_FAILED = "fake_prefix_cache_validation_failed"
REAL_SEED_INJECTION_FAILED = "real_seed_injection_failed"
REAL_SEED_WARM_INJECTION_FAILED = "real_seed_warm_injection_failed"
REAL_SEED_VALIDATION_FAILED = "real_seed_cache_validation_failed"

# --- the graph a point's steps run in (a row's graph.reasons) --------------------------------
CAPTURE = "capture"  # B (decode) or N (prefill) is a capture size
POST_CAPTURE = "post_capture"  # one past a capture size: the next graph, padded
EAGER_TAIL = "eager_tail"  # beyond the largest capture size: eager
CUDAGRAPH_DISABLED = "cudagraph_disabled"  # no graphs at all (enforce_eager, CPU)
ENGINE_LIMIT = "engine_limit"  # the engine's largest batch or token count
GRAPH_REASONS = (CAPTURE, POST_CAPTURE, EAGER_TAIL, CUDAGRAPH_DISABLED, ENGINE_LIMIT)

# --- why a shadow registration was refused (the detail of decode_injection_failed) ---------
CHAIN_TOO_SHALLOW = "chain_too_shallow"
POOL_EXHAUSTED = "pool_exhausted"
LAYOUT_UNSUPPORTED = "layout_unsupported"
LAYOUT_UNKNOWN = "layout_unknown"  # a group whose spec the layout cannot classify
FORK_UNSUPPORTED = "fork_unsupported"
HOOKS_MISSING = "hooks_missing"
STATE_MODE_UNUSABLE = "state_mode_unusable"
STATE_MISSING = "state_missing"

# --- the served-step trace (docs/validate-reference.md#the-trace): served.recorder writes it ---
TRACE_TYPE = "kvwarm_trace"  # the header's `type`
TRACE_SCHEMA_VERSION = 3  # 3: a step's gap and untimed reason, the dropped records (2: raw numbers; 1: composed)
TRACE_BASIS = "update_to_update"  # a step's `wall`: one update end to the next, as a decode row's
TRACE_CLOCK = "perf_counter"
# a step's `untimed`: why its `wall` is null (besides a rank's first step and an idle wait)
TRACE_UNTIMED_SWEEP = "sweep_between_points"  # its window holds the sweep's own work between points
TRACE_UNTIMED_UNKNOWN = "unknown_output"  # its output was not seen scheduled (docs/hooks.md, H1 and H2)
TRACE_UNTIMED = (TRACE_UNTIMED_SWEEP, TRACE_UNTIMED_UNKNOWN)
TRACE_DROPPED = "dropped"  # the key of a record of the steps dropped at the writer's bound


def trace_launch(started: datetime, pid: int) -> str:
    """What makes one launch's trace file names its own: its start (UTC, to the microsecond)
    and its process id."""
    return f"{started:%Y%m%dT%H%M%S%f}-p{pid}"


def trace_file_name(rank: int, launch: str, rotation: int = 0) -> str:
    """A launch's trace file of a rank: the current one, or its k-th rotated predecessor (1 the
    newest)."""
    return f"trace-dp{rank}-{launch}.{rotation}.jsonl" if rotation else f"trace-dp{rank}-{launch}.jsonl"
