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

from dataclasses import dataclass

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
    prefix_caching: bool
    vllm_config: object  # for the checks of continuations and mixed points
    mixed_refused: str | None  # why mixed points cannot run here (None: they can)

    @classmethod
    def of(cls, vllm_config, kv_cache_manager, free: int | None = None, state_mode: str | None = None):
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
            prefix_caching=bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False)),
            vllm_config=vllm_config,
            mixed_refused=mixed_refusal(all(g.kind == ATTENTION for g in layouts), state_mode),
        )

    def chains(self, batch: int, depth: int) -> int:
        """Blocks a rung's `batch` chains of `depth` tokens hold."""
        return batch * chain_blocks(self.layouts, depth) if depth else 0


def check_points(
    points: list, vllm_config, kv_cache_manager, source: str, free: int | None = None, state_mode: str | None = None
) -> None:
    """`free`: the blocks the pool check allows (default: this pool's free ones, less any
    watermark; a grid under data parallel passes the ranks' smallest); `state_mode`: how the
    sweep hands recurrent state over (SweepConfig.state_mode; None: on fake KV, or no state)."""
    limits = EngineLimits.of(vllm_config, kv_cache_manager, free, state_mode)
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
    _check_continuations(prefill, limits.vllm_config, limits.unit, source)
    shots = {point: _shot(point, limits, source) for point in prefill}  # per point: its prefix, its shot's blocks
    # A rung's chains are as deep as its deepest prefix, whatever the file's order: every
    # point's shot runs beside them.
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


class GridFit:
    """A generated grid's points kept one at a time, each where check_points passes it beside
    the points kept before it, in constant time per point: per rung (a batch size) the deepest
    prefix kept and the largest shot kept, so a point is checked against its rung's chains
    without walking the rung (a deeper prefix deepens its rung-mates' chains too)."""

    def __init__(self, limits: EngineLimits, source: str):
        self.limits, self.source = limits, source
        self.kept: list = []
        self._deepest: dict[int, int] = {}  # batch: the deepest prefix of its rung so far
        self._shot: dict[int, int] = {}  # batch: the most blocks one of its rung's shots takes

    def add(self, point) -> bool:
        """Whether `point` is kept (it fits beside the kept ones, which it then joins)."""
        limits, source = self.limits, self.source
        part = point.prefill if isinstance(point, MixedPoint) else point if isinstance(point, PrefillPoint) else None
        try:
            if point.batch_size > limits.max_seqs:
                return False
            _check_mixed([point], limits, source)
            if part is not None:
                _check_prefixed([part], limits, source)
                _check_continuations([part], limits.vllm_config, limits.unit, source)
                prefix, shot = _shot(part, limits, source)
        except PointsFileError:
            return False
        if part is not None:
            batch = part.batch_size
            deepest, widest = max(self._deepest.get(batch, 0), prefix), max(self._shot.get(batch, 0), shot)
            if limits.chains(batch, deepest) + widest > limits.free:
                return False
            self._deepest[batch], self._shot[batch] = deepest, widest
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
