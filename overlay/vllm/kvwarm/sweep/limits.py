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

from dataclasses import dataclass

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


@dataclass(frozen=True)
class EngineLimits:
    """What the point checks read of the engine, read once (`free`: the blocks the pool check
    allows; `state_mode`: as check_points')."""

    max_seqs: int
    budget: int  # max_num_batched_tokens
    threshold: int  # long_prefill_token_threshold (0: none)
    max_model_len: int
    layouts: list
    unit: int  # the prefix-cache unit
    free: int
    state_mode: str | None
    decode_steps: int  # what a decode point's requests run after their admission
    prefix_caching: bool
    vllm_config: object  # for the checks of continuations and mixed points
    mixed_refused: str | None  # why mixed points cannot run here (None: they can)

    @classmethod
    def of(
        cls,
        vllm_config,
        kv_cache_manager,
        free: int | None = None,
        state_mode: str | None = None,
        decode_steps: int = 0,
    ):
        scheduler_config = vllm_config.scheduler_config
        layouts = group_layouts(kv_cache_manager)
        if free is None:
            free = kv_cache_manager.block_pool.get_num_free_blocks() - getattr(kv_cache_manager, "watermark_blocks", 0)
        return cls(
            max_seqs=scheduler_config.max_num_seqs,
            budget=scheduler_config.max_num_batched_tokens,
            threshold=getattr(scheduler_config, "long_prefill_token_threshold", 0) or 0,
            max_model_len=vllm_config.model_config.max_model_len,
            layouts=layouts,
            unit=prefix_unit(layouts, kv_cache_manager.block_pool.hash_block_size),
            free=free,
            state_mode=state_mode,
            decode_steps=decode_steps,
            prefix_caching=bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False)),
            vllm_config=vllm_config,
            mixed_refused=mixed_refusal(all(g.kind == ATTENTION for g in layouts), state_mode),
        )

    def chains(self, batch: int, depth: int) -> int:
        """Blocks a rung's `batch` chains of `depth` tokens hold."""
        return batch * chain_blocks(self.layouts, depth) if depth else 0


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
    limits = EngineLimits.of(vllm_config, kv_cache_manager, free, state_mode, decode_steps)
    too_wide = sorted({p.batch_size for p in points if p.batch_size > limits.max_seqs})
    if too_wide:
        raise PointsFileError(
            f"{source}: batch size(s) {too_wide} exceed max_num_seqs {limits.max_seqs}, so no step could run such "
            f"a batch; start the engine with --max-num-seqs {too_wide[-1]} or more"
        )
    _check_mixed(points, limits, source)
    # a mixed point's prefill part runs beside its own chains, checked as a prefill point of its own rung
    prefill = [p for p in points if isinstance(p, PrefillPoint)] + [
        p.prefill for p in points if isinstance(p, MixedPoint)
    ]
    _check_prefixed(prefill, limits, source)
    _check_continuations(prefill, vllm_config, limits.unit, source)
    shots = {point: _shot(point, limits, source) for point in prefill}  # per point: its prefix, its shot's blocks
    # A rung's chains are as deep as its deepest prefix, whatever the file's order: every
    # point's shot runs beside them. A mixed point's prefill part runs beside its own rung's
    # chains (_check_mixed_pool), not a prefill rung's.
    parts = {p.prefill for p in points if isinstance(p, MixedPoint)} - {
        p for p in points if isinstance(p, PrefillPoint)
    }
    shots = {point: shot for point, shot in shots.items() if point not in parts}
    deepest: dict[int, int] = {}
    for point, (prefix, _) in shots.items():
        deepest[point.batch_size] = max(deepest.get(point.batch_size, 0), prefix)
    for point, (_, shot) in shots.items():
        depth = deepest[point.batch_size]
        need = limits.chains(point.batch_size, depth) + shot
        if need > limits.free:
            raise PointsFileError(
                f"{source}: prefill point {_name(point)}: its rung's chains ({point.batch_size} of {depth} tokens, "
                f"the rung's deepest prefix) and one shot need {need} KV blocks, the pool has {limits.free} free; "
                "lower N or P (of this point or of its rung's deepest) or give the engine more KV cache memory"
            )
    _check_mixed_pool(points, limits, source)


class GridFit:
    """A generated grid's points kept one at a time, each where check_points passes it beside
    the points kept before it, in constant time per point: per rung the deepest its chains must
    be and the largest shot kept, so a point is checked against its rung's chains without
    walking the rung (a deeper point deepens its rung-mates' chains too). A prefill point's
    rung is its batch size; a mixed point's is its own (sweep.plan.mixed_chains)."""

    def __init__(self, limits: EngineLimits, source: str):
        self.limits, self.source = limits, source
        self.kept: list = []
        self._rungs: dict[tuple[bool, int], tuple[int, int]] = {}  # (mixed, chains): (depth, largest shot)

    def add(self, point) -> bool:
        """Whether `point` is kept (it fits beside the kept ones, which it then joins)."""
        limits, source = self.limits, self.source
        mixed = isinstance(point, MixedPoint)
        part = point.prefill if mixed else point if isinstance(point, PrefillPoint) else None
        try:
            if point.batch_size > limits.max_seqs:
                return False
            _check_mixed([point], limits, source)
            if part is not None:
                _check_prefixed([part], limits, source)
                _check_continuations([part], limits.vllm_config, limits.unit, source)
                depth, shot = _shot(part, limits, source)  # a mixed point's part: its step's checks alone
            if mixed:
                depth, shot = mixed_point_needs(
                    point, limits.layouts, limits.unit, limits.decode_steps, limits.state_mode, limits.max_model_len
                )
        except PointsFileError:
            return False
        if part is not None:
            chains = mixed_chains(point) if mixed else part.batch_size
            rung = (mixed, chains)
            held_depth, held_shot = self._rungs.get(rung, (0, 0))
            depth, shot = max(held_depth, depth), max(held_shot, shot)
            if limits.chains(chains, depth) + shot > limits.free:
                return False
            self._rungs[rung] = depth, shot
        self.kept.append(point)
        return True


def _check_prefixed(prefill: list, limits: EngineLimits, source: str) -> None:
    prefixed = [p for p in prefill if p.total_kv_read_tokens]
    if prefixed and not limits.prefix_caching:
        raise PointsFileError(
            f"{source}: {len(prefixed)} prefill point(s) read a prefix (P > 0, e.g. "
            f"{_name(prefixed[0])}), which only the prefix cache holds; start the engine with "
            "--enable-prefix-caching, or give those points P = 0"
        )


def _shot(point: PrefillPoint, limits: EngineLimits, source: str) -> tuple[int, int]:
    """A prefill point checked alone: its deepest request prefix and the blocks its shot takes."""
    where = f"{source}: prefill point {_name(point)}"
    try:
        prefixes = point.prefixes(limits.unit)
    except PointsFileError as err:
        raise PointsFileError(f"{source}: {err}") from None
    new = point.new_tokens()
    if point.total_prefill_tokens > limits.budget:
        raise PointsFileError(
            f"{where}: {point.total_prefill_tokens} new tokens exceed max_num_batched_tokens {limits.budget}, so the "
            f"engine would chunk the step; lower N or start the engine with --max-num-batched-tokens "
            f"{point.total_prefill_tokens} or more"
        )
    if 0 < limits.threshold < max(new):
        raise PointsFileError(
            f"{where}: a request of {max(new)} new tokens exceeds long_prefill_token_threshold {limits.threshold}, "
            "so the engine would chunk it; raise batch_size, lower N or raise the threshold"
        )
    max_model_len = limits.max_model_len
    if point.tokens_spanned(limits.unit) > max_model_len or max(prefixes) > max_model_len - CHAIN_DEPTH_MARGIN:
        raise PointsFileError(
            f"{where}: a request of {max(p + n for p, n in zip(prefixes, new))} prompt tokens and its sampled "
            f"token do not fit max_model_len {max_model_len}; lower N or P, raise batch_size or start the "
            "engine with a larger --max-model-len"
        )
    return max(prefixes), sum(new_request_blocks(limits.layouts, p, n) for p, n in zip(prefixes, new))


def mixed_point_needs(point: MixedPoint, layouts, unit: int, decode_steps: int, state_mode, max_model_len: int):
    """What one mixed point asks of its rung: (the depth its chains need, in tokens, the blocks
    its shot holds beside them). The chains (sweep.plan.plan_mixed_rung) are as deep as the
    decode part's deepest context with its admission token and the steps its shadows run
    (points.mixed_decode_steps), or the prefill part's deepest prefix; the shot holds the
    shadows' private tails (and in exact state each shadow's catch-up) and the prefill part's
    new requests' blocks past their hits."""
    steps = mixed_decode_steps(decode_steps)
    contexts = injected_contexts(point.decode)
    prefill = point.prefill
    prefixes = prefill.prefixes(unit)
    depth = min(max(max(contexts) + 1 + steps, max(prefixes)), max_model_len - CHAIN_DEPTH_MARGIN)
    catchup = planned_catchup_blocks(layouts) if state_mode == v.EXACT else 0
    tails = sum(shadow_private_blocks(layouts, ctx, steps, state_mode == v.COPY) + catchup for ctx in contexts)
    new = sum(new_request_blocks(layouts, a, n) for a, n in zip(prefixes, prefill.new_tokens()))
    return depth, tails + new


def mixed_rung_blocks(
    rung: list[MixedPoint], layouts, unit: int, decode_steps: int, state_mode: str | None, max_model_len: int
) -> tuple[int, int, dict[MixedPoint, int]]:
    """What a rung of mixed points holds at once, in blocks, as the sweep builds and runs it:
    (its chains' depth in tokens, the chains' blocks, each point's shot's blocks): max(B_decode,
    B_prefill) chains (sweep.plan.mixed_chains) as deep as its deepest point needs."""
    needs = {p: mixed_point_needs(p, layouts, unit, decode_steps, state_mode, max_model_len) for p in rung}
    depth = max(d for d, _ in needs.values())
    return depth, mixed_chains(rung[0]) * chain_blocks(layouts, depth), {p: shot for p, (_, shot) in needs.items()}


def _mixed_rungs(points: list) -> dict[int, list[MixedPoint]]:
    """The mixed points by rung (its chains: the larger part's batch), as sweep.plan lays them."""
    rungs: dict[int, list[MixedPoint]] = {}
    for p in points:
        if isinstance(p, MixedPoint):
            rungs.setdefault(mixed_chains(p), []).append(p)
    return rungs


def _check_mixed_pool(points: list, limits: EngineLimits, source: str) -> None:
    for rung in _mixed_rungs(points).values():
        depth, chains, shots = mixed_rung_blocks(
            rung, limits.layouts, limits.unit, limits.decode_steps, limits.state_mode, limits.max_model_len
        )
        for point, shot in shots.items():
            if chains + shot > limits.free:
                raise PointsFileError(
                    f"{source}: mixed point {point.name()}: its rung's chains ({mixed_chains(point)} of {depth} "
                    "tokens: one per request of the larger part, as deep as the rung's deepest decode context and "
                    f"the steps its shadows run, or its deepest prefix) and its shot need {chains + shot} KV blocks, "
                    f"the pool has {limits.free} free; lower K, N or P (of this point or of its rung's deepest) or "
                    "give the engine more KV cache memory"
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


def _check_mixed(points: list, limits: EngineLimits, source: str) -> None:
    mixed = [p for p in points if isinstance(p, MixedPoint)]
    if not mixed:
        return
    check_budget(mixed, limits.budget, source)
    if limits.mixed_refused:
        raise PointsFileError(
            f"{source}: mixed point {mixed[0].name()}: {limits.mixed_refused}; drop the mixed points to sweep the rest"
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
