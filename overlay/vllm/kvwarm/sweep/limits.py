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
  runs it unchunked beside the decodes). Its rung fits the KV pool as the real rung needs it
  (`mixed_rung_blocks`): max(B_decode, B_prefill) chains (sweep.plan.mixed_chains), each as
  deep as the rung's deepest decode context with the admission token and the steps its
  shadows run, or its deepest prefix, and beside them each point's shot: the shadows' tails
  (and in exact state their catch-ups) and the prefill part's new blocks; a point beyond it
  is refused by name. Once the ranks agree on the pool at the rung's start, the points beyond
  it go to fake KV (`trim_mixed_rung`), so a rung never waits on blocks it cannot get. Mixed
  points are measured at any data-parallel size (their shots run as a prefill point's, with a
  trailing untimed one over several ranks: sweep.mixed_runner), on attention-only layouts and
  on layouts with recurrent state whose sweep hands the state over on real KV by exact
  state (the decode part's catch-ups, sweep.catchups) or copy. Elsewhere they are refused
  (`mixed_refusal`, by which a generated grid lays none): in place lends the chains' own
  state block to the decode part, the chains whose cached prefixes the prefill part hits,
  and a sweep on fake KV has no hand-off at all.
"""

from __future__ import annotations

from ..kv.arithmetic import chain_blocks, shadow_private_blocks
from ..kv.catchup import planned_catchup_blocks
from ..kv.layout import ATTENTION, group_layouts
from ..kv.prefix import new_request_blocks, prefix_unit
from ..kv.state_mode import STATE_ENV
from ..record import vocabulary as v
from .plan import CHAIN_DEPTH_MARGIN, Rung, SweepConfig, injected_contexts, mixed_chains
from .points import MixedPoint, PointsFileError, PrefillPoint, check_budget, mixed_decode_steps
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
    points: list,
    vllm_config,
    kv_cache_manager,
    source: str,
    free: int | None = None,
    state_mode: str | None = None,
    decode_steps: int = 0,
) -> None:
    """`free`: the blocks the pool check allows (default: this pool's free ones, less any
    watermark; a grid under data parallel passes the ranks' smallest); `state_mode`: how the
    sweep hands recurrent state over (SweepConfig.state_mode; None: on fake KV, or no state);
    `decode_steps`: what a decode point's requests run after their admission
    (SweepConfig.decode_steps), which a mixed point's shadows run more of."""
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
    # point's shot runs beside them. A mixed point's prefill part runs beside its own rung's
    # chains (_check_mixed_pool), not a prefill rung's.
    parts = {p.prefill for p in points if isinstance(p, MixedPoint)} - {
        p for p in points if isinstance(p, PrefillPoint)
    }
    splits = {point: split for point, split in splits.items() if point not in parts}
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
    _check_mixed_pool(points, layouts, unit, decode_steps, state_mode, max_model_len, free, source)


def mixed_rung_blocks(
    rung: list[MixedPoint], layouts, unit: int, decode_steps: int, state_mode: str | None, max_model_len: int
) -> tuple[int, int, dict[MixedPoint, int]]:
    """What a rung of mixed points holds at once, in blocks, as the sweep builds and runs it:
    (its chains' depth in tokens, the chains' blocks, each point's shot's blocks). The chains
    (sweep.plan.plan_mixed_rung) are max(B_decode, B_prefill) of them, each as deep as the
    rung's deepest decode context with its admission token and the steps its shadows run
    (points.mixed_decode_steps), or its deepest prefix; a point's shot beside them holds its
    shadows' private tails (and in exact state each shadow's catch-up) and its prefill part's
    new requests' blocks past their hits."""
    steps = mixed_decode_steps(decode_steps)
    depth = max(max(max(injected_contexts(p.decode)) + 1 + steps, max(p.prefill.prefixes(unit))) for p in rung)
    depth = min(depth, max_model_len - CHAIN_DEPTH_MARGIN)
    catchup = planned_catchup_blocks(layouts) if state_mode == v.EXACT else 0
    shots = {}
    for p in rung:
        tails = sum(
            shadow_private_blocks(layouts, ctx, steps, state_mode == v.COPY) + catchup
            for ctx in injected_contexts(p.decode)
        )
        prefill = p.prefill
        new = sum(new_request_blocks(layouts, a, n) for a, n in zip(prefill.prefixes(unit), prefill.new_tokens()))
        shots[p] = tails + new
    return depth, mixed_chains(rung[0]) * chain_blocks(layouts, depth), shots


def _mixed_rungs(points: list) -> dict[int, list[MixedPoint]]:
    """The mixed points by rung (its chains: the larger part's batch), as sweep.plan lays them."""
    rungs: dict[int, list[MixedPoint]] = {}
    for p in points:
        if isinstance(p, MixedPoint):
            rungs.setdefault(mixed_chains(p), []).append(p)
    return rungs


def _check_mixed_pool(points, layouts, unit, decode_steps, state_mode, max_model_len, free, source) -> None:
    for rung in _mixed_rungs(points).values():
        depth, chains, shots = mixed_rung_blocks(rung, layouts, unit, decode_steps, state_mode, max_model_len)
        for point, shot in shots.items():
            if chains + shot > free:
                raise PointsFileError(
                    f"{source}: mixed point {point.name()}: its rung's chains ({mixed_chains(point)} of {depth} "
                    "tokens: one per request of the larger part, as deep as the rung's deepest decode context and "
                    f"the steps its shadows run, or its deepest prefix) and its shot need {chains + shot} KV blocks, "
                    f"the pool has {free} free; lower K, N or P (of this point or of its rung's deepest) or give "
                    "the engine more KV cache memory"
                )


def trim_mixed_rung(rung: Rung, layouts, config: SweepConfig, usable: int, unit: int) -> None:
    """Once the ranks agree on the pool at a mixed rung's start (`usable`: their smallest),
    the points whose chains and shot it cannot hold go to fake KV, the deepest first, so the
    rung never waits on blocks it cannot get (what the pool lost to served requests since the
    points were checked)."""
    while rung.points:
        _, chains, shots = mixed_rung_blocks(
            rung.points, layouts, unit, config.decode_steps, config.state_mode, config.max_model_len
        )
        if chains + max(shots.values()) <= usable:
            return
        rung.fake_points.insert(0, rung.points.pop(0))  # the rung's points are deepest first


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
