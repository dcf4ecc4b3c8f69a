"""What the engine allows, checked once it is known and before anything runs: every point
must be one step of the shape its row will say, or the sweep stops with a message that names
the point, the limit and the fix.

- Speculative decoding and pipeline parallelism are refused: a timed step there would not
  be the shape the row says (draft tokens change a decode step; pipeline stages split one).
- Every batch fits max_num_seqs.
- A prefill point is one unchunked step: its N new tokens fit max_num_batched_tokens, each
  request's fit long_prefill_token_threshold where one is set, its prefix is whole blocks of
  the prefix-cache unit (on a hybrid layout the state block: a state is cached only at its
  boundaries), each request fits max_model_len, and its shot fits the KV pool beside its
  rung's chains (as deep as the rung's deepest prefix, whatever the file's order).
- A prefill point with a prefix (P > 0) needs the prefix cache: without it nothing is found.
- A continuation point (its requests running, their prefix computed by a lead step of their
  own: one prefix block each, all in one step within max_num_batched_tokens) needs chunked
  prefill (else no prompt is continued in a later step) and one data-parallel rank (a shot
  is two steps; ranks a step apart would time one beside the other's lead).
- A mixed point is one step: its decode requests' tokens and its prefill part's N fit
  max_num_batched_tokens, and its prefill part passes the prefill checks (so that the engine
  runs it unchunked beside the decodes). Mixed points are measured at any data-parallel
  size (the ranks meet at every shot as for prefill points), on attention-only layouts and
  on layouts with recurrent state whose sweep hands the state over on real KV by exact
  state (the decode part's catch-ups, sweep.catchups) or copy. Elsewhere they are refused
  (`mixed_refusal`, by which a generated grid lays none): in place lends the chains' own
  state block to the decode part, the chains whose cached prefixes the prefill part hits,
  and a sweep on fake KV has no hand-off at all.
"""

from __future__ import annotations

from ..kv.arithmetic import chain_blocks
from ..kv.layout import ATTENTION, group_layouts
from ..kv.prefix import new_request_blocks, prefix_unit
from ..kv.state_mode import STATE_ENV
from ..record import vocabulary as v
from .plan import CHAIN_DEPTH_MARGIN
from .points import MixedPoint, PointsFileError, PrefillPoint, check_budget
from .provenance import rank_layout


class SweepRefused(ValueError):
    """The engine's configuration cannot give faithful rows: `reason` names why."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def check_engine(vllm_config) -> None:
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise SweepRefused(
            v.SPECULATIVE_DECODING_UNSUPPORTED,
            "a decode step with draft tokens is not the one-token step a row says; start the engine without "
            "speculative decoding to sweep it",
        )
    if getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) > 1:
        raise SweepRefused(
            v.PIPELINE_PARALLEL_UNSUPPORTED,
            "a step split over pipeline stages is not the step a row says; sweep with --pipeline-parallel-size 1",
        )


def check_points(
    points: list, vllm_config, kv_cache_manager, source: str, free: int | None = None, state_mode: str | None = None
) -> None:
    """`free`: the blocks the pool check allows (default: this pool's free ones, less any
    watermark; a grid under data parallel passes the ranks' smallest); `state_mode`: how the
    sweep hands recurrent state over (SweepConfig.state_mode; None: on fake KV, or no state)."""
    scheduler_config = vllm_config.scheduler_config
    max_seqs = scheduler_config.max_num_seqs
    too_wide = sorted({p.batch_size for p in points if p.batch_size > max_seqs})
    if too_wide:
        raise PointsFileError(
            f"{source}: batch size(s) {too_wide} exceed max_num_seqs {max_seqs}, so no step could run such a "
            f"batch; start the engine with --max-num-seqs {too_wide[-1]} or more"
        )
    layouts = group_layouts(kv_cache_manager)
    unit = prefix_unit(layouts, kv_cache_manager.block_pool.hash_block_size)
    budget = scheduler_config.max_num_batched_tokens
    threshold = getattr(scheduler_config, "long_prefill_token_threshold", 0) or 0
    max_model_len = vllm_config.model_config.max_model_len
    if free is None:
        free = kv_cache_manager.block_pool.get_num_free_blocks() - getattr(kv_cache_manager, "watermark_blocks", 0)
    _check_mixed(points, vllm_config, layouts, source, state_mode)
    # a mixed point's prefill part runs beside its own chains, checked as a prefill point of its own rung
    prefill = [p for p in points if isinstance(p, PrefillPoint)] + [
        p.prefill for p in points if isinstance(p, MixedPoint)
    ]
    prefixed = [p for p in prefill if p.total_kv_read_tokens]
    if prefixed and not getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        raise PointsFileError(
            f"{source}: {len(prefixed)} prefill point(s) read a prefix (P > 0, e.g. "
            f"{_name(prefixed[0])}), which only the prefix cache holds; start the engine with "
            "--enable-prefix-caching, or give those points P = 0"
        )
    _check_continuations(prefill, vllm_config, unit, source)
    splits = {}  # per point: its requests' prefixes and new tokens
    for point in prefill:
        where = f"{source}: prefill point {_name(point)}"
        try:
            prefixes = point.prefixes(unit)
        except PointsFileError as err:
            raise PointsFileError(f"{source}: {err}") from None
        new = point.new_tokens()
        if point.total_prefill_tokens > budget:
            raise PointsFileError(
                f"{where}: {point.total_prefill_tokens} new tokens exceed max_num_batched_tokens {budget}, so the "
                f"engine would chunk the step; lower N or start the engine with --max-num-batched-tokens "
                f"{point.total_prefill_tokens} or more"
            )
        if 0 < threshold < max(new):
            raise PointsFileError(
                f"{where}: a request of {max(new)} new tokens exceeds long_prefill_token_threshold {threshold}, "
                "so the engine would chunk it; raise batch_size, lower N or raise the threshold"
            )
        if point.tokens_spanned(unit) > max_model_len or max(prefixes) > max_model_len - CHAIN_DEPTH_MARGIN:
            raise PointsFileError(
                f"{where}: a request of {max(p + n for p, n in zip(prefixes, new))} prompt tokens and its sampled "
                f"token do not fit max_model_len {max_model_len}; lower N or P, raise batch_size or start the "
                "engine with a larger --max-model-len"
            )
        splits[point] = prefixes, new
    # A rung's chains are as deep as its deepest prefix, whatever the file's order: every
    # point's shot runs beside them.
    deepest: dict[int, int] = {}
    for point, (prefixes, _) in splits.items():
        deepest[point.batch_size] = max(deepest.get(point.batch_size, 0), max(prefixes))
    for point, (prefixes, new) in splits.items():
        depth = deepest[point.batch_size]
        chains = point.batch_size * chain_blocks(layouts, depth) if depth else 0
        need = chains + sum(new_request_blocks(layouts, p, n) for p, n in zip(prefixes, new))
        if need > free:
            raise PointsFileError(
                f"{source}: prefill point {_name(point)}: its rung's chains ({point.batch_size} of {depth} tokens, "
                f"the rung's deepest prefix) and one shot need {need} KV blocks, the pool has {free} free; lower N "
                "or P (of this point or of its rung's deepest) or give the engine more KV cache memory"
            )


def mixed_refusal(attention_only: bool, state_mode: str | None = None) -> str | None:
    """Why this engine cannot measure mixed points (None: it can), which a points file's mixed
    points are refused by and a generated grid lays none by. `state_mode`: as check_points'."""
    if attention_only or state_mode in (v.EXACT, v.COPY):
        return None
    if state_mode == v.INPLACE:
        return (
            "this model keeps recurrent state, and state mode inplace lends the chains' own state block to the "
            f"decode part, the chains whose cached prefixes the prefill part reads (set {STATE_ENV}=exact or auto "
            "to measure them)"
        )
    return (
        "this model keeps recurrent state, which a mixed point's decode part takes over on real KV only (exact "
        "state or copy), and this sweep measures on fake KV"
    )


def _check_mixed(points: list, vllm_config, layouts, source: str, state_mode: str | None) -> None:
    mixed = [p for p in points if isinstance(p, MixedPoint)]
    if not mixed:
        return
    check_budget(mixed, vllm_config.scheduler_config.max_num_batched_tokens, source)
    why = mixed_refusal(all(g.kind == ATTENTION for g in layouts), state_mode)
    if why:
        raise PointsFileError(
            f"{source}: mixed point {mixed[0].name()}: {why}; drop the mixed points to sweep the rest"
        )


def _check_continuations(prefill: list, vllm_config, unit: int, source: str) -> None:
    continued = [p for p in prefill if p.continuation]
    if not continued:
        return
    budget = vllm_config.scheduler_config.max_num_batched_tokens
    for point in continued:
        if point.batch_size * point.lead(unit) > budget:
            raise PointsFileError(
                f"{source}: prefill point {_name(point)}: its lead step computes {point.lead(unit)} tokens (one prefix "
                f"block) for each of its {point.batch_size} requests, beyond max_num_batched_tokens {budget}; lower "
                f"batch_size to {max(1, budget // point.lead(unit))} or start the engine with "
                f"--max-num-batched-tokens {point.batch_size * point.lead(unit)} or more"
            )
    where = f"{source}: prefill point {_name(continued[0])}"
    if getattr(vllm_config.scheduler_config, "enable_chunked_prefill", True) is False:
        raise PointsFileError(
            f"{where}: a continuation is a prompt's later chunk, and this engine runs without chunked prefill, "
            "so it never continues a prompt; start the engine with --enable-chunked-prefill or drop continuation"
        )
    if rank_layout(vllm_config.parallel_config).data_parallel_size > 1:
        raise PointsFileError(
            f"{where}: continuation points are measured at one data-parallel rank (a shot is two steps, and ranks "
            "a step apart would time one beside another's lead step); sweep them with --data-parallel-size 1"
        )


def _name(point: PrefillPoint) -> str:
    return f"N={point.total_prefill_tokens} P={point.total_kv_read_tokens} B={point.batch_size}" + (
        " (continuation)" if point.continuation else ""
    )
