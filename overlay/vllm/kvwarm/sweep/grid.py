"""The grid a sweep measures when no points file is given (`--grid`, or "grid": true): points
laid around the engine's CUDA-graph capture sizes (sweep.graphs), where step time jumps.

  decode   batch axis: every decode capture size C up to the feasible maximum and C + 1
           (the first batch that falls into the next graph), a doubling tail past the
           largest of those sizes, and the limit; with no capture sizes, powers of two and
           the limit. Per batch a KV ladder: 2B (the shallowest a shadow is admitted at: one
           token short of a 2-token context), powers of two, the deepest the pool and
           max_model_len allow.
  prefill  new-token axis from the prefill capture sizes the same way, up to what one step
           of B requests can hold (max_num_batched_tokens, and B prompts of
           max_model_len - 1 tokens), at small batch sizes and a few prefix depths (none, a
           quarter and a half of max_model_len per request, in whole prefix blocks); at each
           depth the values past what max_model_len leaves are clamped to that top.
  mixed    at a few decode batches (the decode batch axis up to max_num_seqs - 1 and
           max_num_batched_tokens - 1, thinned to the "mixed" cap without its pairs: a
           mixed step's graph goes by its tokens), each at its ladder's ends (3B: the
           shallowest whose shadows, admitted a token short, reach the first timed shot
           after its gap step unclamped, sweep.points.mixed_gap_steps; and the
           deepest its requests reach over the steps they run, their chains beside a
           chunk's shot, and in exact state their catch-ups, in the pool: mixed_deepest),
           a prefill part of one request of the
           chunk budget (max_num_batched_tokens - B new tokens) and of a quarter step
           (max_num_batched_tokens / 4 - B: both at one step size whatever B), on
           no prefix and on one chunk's (whole prefix blocks, at most half of what
           max_model_len leaves; new tokens past what it leaves clamped to that top). Every
           mixed point is one step within the budget, max_num_seqs and max_model_len, and
           its rung within the pool (lay_mixed). None where the engine cannot measure
           mixed points (sweep.limits.mixed_refusal; `mixed_note` says why).

Each axis is thinned to a cap of values (CAPS; "grid": {...} in the sweep's config sets
them, each within its bound, CAP_BOUNDS) on a log scale (`thin`): its first unit, its
doubling tail and its limit are always kept, and C / C + 1 pairs are kept or dropped whole.
The grid is a points file (schema v1, v2 where it holds mixed points), written beside the
artifact for the user to edit and pass back.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..record.shape import GraphConfig
from ..record.vocabulary import EXACT
from .limits import mixed_refusal
from .plan import CHAIN_DEPTH_MARGIN, mixed_chains
from .points import (
    CONTINUATION_SCHEMA,
    MIXED_GAP_STEPS,
    DecodePoint,
    MixedPoint,
    PointsFileError,
    PrefillPoint,
    mixed_decode_steps,
)

PREFILL_BATCHES = (1, 4)
CAPS = {"decode_batches": 12, "kv_ladder": 6, "prefill_tokens": 16, "mixed": 3}
# Each cap's bound: the decode grid is decode_batches x kv_ladder points (at most 65,536), the
# prefill grid 2 batch sizes x 3 depths x prefill_tokens, the mixed grid 8 per mixed batch (its
# ladder's 2 ends x 2 prefixes x 2 chunks: at most 512). Beyond them: write a points file.
CAP_BOUNDS = {"decode_batches": 256, "kv_ladder": 256, "prefill_tokens": 256, "mixed": 64}
POOL_SHARE = 0.8  # of the pool's tokens a rung's chains and shots may take (the rest: slack)


@dataclass(frozen=True)
class GridLimits:
    max_model_len: int
    steady_steps: int
    kv_cache_tokens: int  # tokens the pool holds
    num_blocks: int
    block_size: int  # the attention block size
    prefix_unit: int  # a prefix is whole blocks of this
    attention_only: bool = True  # no recurrent state
    state_mode: str | None = None  # the sweep's hand-off of recurrent state (SweepConfig.state_mode)
    continuations: bool = False  # continuation points can run: chunked prefill, one data-parallel rank


@dataclass(frozen=True)
class Axis:
    values: list[int]
    pairs: set[tuple[int, int]]  # the C / C + 1 pairs in it
    fixed: set[int]  # the doubling tail and the limit: never thinned away


def axis(sizes: tuple[int, ...], limit: int, floor: int = 1) -> Axis:
    """Capture sizes up to `limit`, each with its C + 1, a doubling tail, the limit (no sizes:
    powers of two)."""
    sizes = [s for s in sizes if floor <= s <= limit]
    fixed = {limit}
    if sizes:
        values = set(sizes) | {s + 1 for s in sizes if s + 1 <= limit}
        tail = 2 * max(sizes)
        while tail < limit:
            fixed.add(tail)
            tail *= 2
    else:
        values = {1 << k for k in range(limit.bit_length()) if floor <= 1 << k <= limit}
    values |= fixed
    return Axis(sorted(values), {(s, s + 1) for s in sizes if s + 1 in values}, fixed)


def _units(values: list[int], pairs: set[tuple[int, int]]) -> list[list[int]]:
    """The values in units a thinning keeps or drops whole: a run of C / C + 1 pairs, or one value."""
    units, paired = [], {b for _, b in pairs}
    for value in values:
        if value in paired and units and units[-1][-1] == value - 1:
            units[-1].append(value)
        else:
            units.append([value])
    return units


def thin(values: list[int], pairs: set[tuple[int, int]], cap: int, fixed: set[int] = frozenset()) -> list[int]:
    """At most `cap` values (more only where the fixed ones need it), spread on a log scale.
    The first and last units and every unit holding a `fixed` value are kept; then, while
    the cap has room, the widest gap (in log) between kept values that holds a unit that
    fits gets the unit nearest (in log) to its middle; ties go to the smaller values."""
    units = _units(values, pairs)
    if len(values) <= cap or len(units) <= 2:
        return values
    kept = {0, len(units) - 1} | {i for i, unit in enumerate(units) if fixed & set(unit)}
    room = cap - sum(len(units[i]) for i in kept)
    while True:
        order = sorted(kept)
        best = None  # (width, left, right, the units that fit between)
        for left, right in itertools.pairwise(order):
            fits = [i for i in range(left + 1, right) if len(units[i]) <= room]
            width = round(math.log(units[right][0]) - math.log(units[left][-1]), 9)
            if fits and (best is None or width > best[0]):
                best = (width, left, right, fits)
        if best is None:
            return [value for i in sorted(kept) for value in units[i]]
        _, left, right, fits = best
        middle = (math.log(units[left][-1]) + math.log(units[right][0])) / 2
        pick = min(fits, key=lambda i: (round(abs(math.log(units[i][0]) - middle), 9), i))
        kept.add(pick)
        room -= len(units[pick])


def _ladder(batch: int, deepest: int, cap: int, shallowest: int | None = None) -> list[int]:
    low = 2 * batch if shallowest is None else shallowest
    rungs = {low, deepest} | {1 << k for k in range(deepest.bit_length()) if low < 1 << k < deepest}
    return thin(sorted(rungs), set(), cap)


def feasible_batch(graphs: GraphConfig, limits: GridLimits) -> int:
    """The widest decode batch: a batch needs a chain and a shadow's tail per request (about
    three blocks each)."""
    return max(1, min(graphs.max_num_seqs, limits.num_blocks // 3))


def deepest_kv(batch: int, limits: GridLimits) -> int:
    """The deepest K a decode batch reaches: each context with its steady steps within
    max_model_len, and the chains' K tokens plus each shadow's tail of a couple of blocks
    within the pool."""
    per_request = limits.max_model_len - limits.steady_steps - 1 - CHAIN_DEPTH_MARGIN
    return min(batch * per_request, int(POOL_SHARE * limits.kv_cache_tokens) - 2 * batch * limits.block_size)


def decode_grid(graphs: GraphConfig, limits: GridLimits, caps: dict = CAPS) -> list[DecodePoint]:
    batches = axis(graphs.decode_capture_sizes, feasible_batch(graphs, limits))
    points = []
    for batch in thin(batches.values, batches.pairs, caps["decode_batches"], batches.fixed):
        deepest = deepest_kv(batch, limits)
        if deepest >= 2 * batch:
            points += [DecodePoint(k, batch) for k in _ladder(batch, deepest, caps["kv_ladder"])]
    return points


def prefill_grid(graphs: GraphConfig, limits: GridLimits, caps: dict = CAPS) -> list[PrefillPoint]:
    """Per batch size and prefix depth, the thinned new-token axis; a value past what a
    request's prompt may hold at that depth (max_model_len less the prefix and the sampled
    token) is clamped to that top."""
    points = []
    unit = limits.prefix_unit
    for batch in (b for b in PREFILL_BATCHES if b <= graphs.max_num_seqs):
        top = min(graphs.max_num_batched_tokens, batch * (limits.max_model_len - 1))
        tokens = axis(graphs.prefill_capture_sizes, top, floor=batch)
        kept = thin(tokens.values, tokens.pairs, caps["prefill_tokens"], tokens.fixed)
        depths = sorted({0, *(unit * (limits.max_model_len // (f * unit)) for f in (4, 2))})
        for depth in depths:
            if depth and (depth < unit or depth > limits.max_model_len - CHAIN_DEPTH_MARGIN):
                continue
            most = batch * (limits.max_model_len - 1 - depth)  # each request's prompt and its sampled token fit
            for n in sorted({min(n, most) for n in kept if min(n, most) >= batch}):
                points.append(PrefillPoint(n, depth * batch, batch))
    return points


def mixed_note(limits: GridLimits) -> str | None:
    """Why a grid on this engine lays no mixed point (None: it lays them where they fit)."""
    return mixed_refusal(limits.attention_only, limits.state_mode)


def mixed_batch_limit(graphs: GraphConfig, limits: GridLimits) -> int:
    """The widest decode part: a feasible decode batch, one request and one token short of
    max_num_seqs and the token budget (the prefill part's)."""
    return min(feasible_batch(graphs, limits), graphs.max_num_seqs - 1, graphs.max_num_batched_tokens - 1)


def mixed_deepest(batch: int, graphs: GraphConfig, limits: GridLimits) -> int:
    """The deepest decode part of `batch` requests a grid lays in a mixed point: each context
    with the steps a mixed point's decode requests run within max_model_len less the chains'
    margin, and its chains beside a chunk's shot (max_num_batched_tokens - B new tokens, a
    block, the shadows' tails and catch-ups) within POOL_SHARE of the pool (rung_part)."""
    steps, block = mixed_decode_steps(limits.steady_steps), limits.block_size
    chunk = graphs.max_num_batched_tokens - batch
    pool = int(POOL_SHARE * limits.kv_cache_tokens) - 2 * batch * block - catchup_tokens(batch, limits) - chunk - block
    return batch * min(limits.max_model_len - CHAIN_DEPTH_MARGIN - steps - 1, pool // batch - steps - 1)


def mixed_fits(point: MixedPoint, graphs: GraphConfig, limits: GridLimits) -> bool:
    """Whether a mixed point alone is one step a grid may lay: its step within the token budget
    and max_num_seqs; its decode part at 2B or deeper, its longest request (context, admission
    token and the steps a mixed point's decode requests run) and its prefill part's (prompt and
    sampled token, in whole prefix blocks) within max_model_len less the chains' margin. Its
    rung is held to the pool by lay_mixed."""
    decode, prefill = point.decode, point.prefill
    if point.step_tokens > graphs.max_num_batched_tokens or point.batch_size > graphs.max_num_seqs:
        return False
    try:
        spanned = prefill.tokens_spanned(limits.prefix_unit)
    except PointsFileError:
        return False
    longest = decode.tokens_spanned(mixed_decode_steps(limits.steady_steps))
    return (
        decode.total_kv_read_tokens >= 2 * decode.batch_size
        and max(longest, spanned) <= limits.max_model_len - CHAIN_DEPTH_MARGIN
    )


def rung_part(point: MixedPoint, limits: GridLimits) -> tuple[int, int]:
    """What a mixed point asks of its rung's pool, in tokens: the depth of its chains (one per
    request of the larger part: a decode request's context, admission token and steps, or a
    prefix) and its shot beside them (the shadows' tails of two blocks each and their
    catch-ups, the prefill part's new tokens and a block per request). A rung holds at most
    its chain count x its deepest chain + its largest shot at once."""
    steps, block = mixed_decode_steps(limits.steady_steps), limits.block_size
    decode, prefill = point.decode, point.prefill
    depth = max(decode.tokens_spanned(steps), *prefill.prefixes(limits.prefix_unit))
    shot = (
        2 * decode.batch_size * block
        + catchup_tokens(decode.batch_size, limits)
        + prefill.total_prefill_tokens
        + prefill.batch_size * block
    )
    return depth, shot


def catchup_tokens(batch: int, limits: GridLimits) -> int:
    """In exact state, the tokens a decode part's catch-ups hold at most beside its chains
    (sweep.catchups): per shadow the state block past its last cached boundary, and a block."""
    return batch * (limits.prefix_unit + limits.block_size) if limits.state_mode == EXACT else 0


def lay_mixed(candidates: list[MixedPoint], graphs: GraphConfig, limits: GridLimits) -> list[MixedPoint]:
    """The candidates a grid lays, in their order: each once, where it fits alone (mixed_fits)
    and its rung (the kept points of its chain count, and it) stays within POOL_SHARE of the
    pool (rung_part), as deepest_kv holds a decode rung. Per chain count the deepest chain
    and the largest shot kept so far are kept, so each candidate costs the same."""
    kept: list[MixedPoint] = []
    seen: set[MixedPoint] = set()
    rungs: dict[int, tuple[int, int]] = {}  # chain count: (deepest chain, largest shot) kept
    room = POOL_SHARE * limits.kv_cache_tokens
    for point in candidates:
        if point in seen or not mixed_fits(point, graphs, limits):
            continue
        chains = mixed_chains(point)
        (depth, shot), (deepest, largest) = rung_part(point, limits), rungs.get(chains, (0, 0))
        deepest, largest = max(deepest, depth), max(largest, shot)
        if chains * deepest + largest <= room:
            rungs[chains] = deepest, largest
            seen.add(point)
            kept.append(point)
    return kept


def mixed_grid(graphs: GraphConfig, limits: GridLimits, caps: dict = CAPS) -> list[MixedPoint]:
    """Per decode batch B (the decode batch axis thinned to caps["mixed"], without its pairs)
    and K at its ladder's ends, one prefill request of the chunk (max_num_batched_tokens - B)
    and of a quarter step (max_num_batched_tokens / 4 - B, where that is a token or more),
    on no prefix and on one chunk's (whole blocks, at most half of max_model_len): the later
    chunk of a chunked prompt, so a continuation where the engine measures continuations
    (limits.continuations); a value past what max_model_len leaves the request is clamped to
    that top. None where the engine cannot measure mixed points (mixed_note)."""
    widest = mixed_batch_limit(graphs, limits)
    if mixed_note(limits) is not None or widest < 1:
        return []
    unit, budget = limits.prefix_unit, graphs.max_num_batched_tokens
    room = limits.max_model_len - CHAIN_DEPTH_MARGIN  # a request's tokens, its sampled one among them
    batches = axis(graphs.decode_capture_sizes, widest)
    candidates = []
    for batch in thin(batches.values, set(), caps["mixed"]):
        chunk = budget - batch
        depth = unit * (min(chunk, room // 2) // unit)
        deepest = mixed_deepest(batch, graphs, limits)
        shallowest = (2 + MIXED_GAP_STEPS) * batch  # admitted a token short, less the gap's token
        if deepest < shallowest:
            continue
        for k in _ladder(batch, deepest, 2, shallowest):
            for prefix in sorted({0, depth} if depth >= unit else {0}):
                # the chunk and a quarter step: every decode batch at the same step tokens
                # T = N + B, the axis validate reads mixed rows along (record.validate.predict)
                for n in sorted({min(n, room - 1 - prefix) for n in (chunk, budget // 4 - batch)}):
                    if n >= 1:
                        part = PrefillPoint(n, prefix, 1, limits.continuations and prefix > 0)
                        candidates.append(MixedPoint(DecodePoint(k, batch), part))
    return lay_mixed(candidates, graphs, limits)


def points_file(points: list) -> dict:
    """The grid as a points file of the oldest schema that holds it: v1 (Dynamo's shape), v2
    where it holds mixed points, v3 where it holds continuations."""
    mixed = [p for p in points if isinstance(p, MixedPoint)]
    prefill = [p for p in points if isinstance(p, PrefillPoint)] + [p.prefill for p in mixed]
    data = {
        "schema_version": CONTINUATION_SCHEMA if any(p.continuation for p in prefill) else 2 if mixed else 1,
        "prefill": [_prefill_entry(p) for p in points if isinstance(p, PrefillPoint)],
        "decode": [_decode_entry(p) for p in points if isinstance(p, DecodePoint)],
    }
    if mixed:
        data["mixed"] = [{"decode": _decode_entry(p.decode), "prefill": _prefill_entry(p.prefill)} for p in mixed]
    return data


def _prefill_entry(p: PrefillPoint) -> dict:
    return {
        "total_prefill_tokens": p.total_prefill_tokens,
        "total_kv_read_tokens": p.total_kv_read_tokens,
        "batch_size": p.batch_size,
        **({"continuation": True} if p.continuation else {}),
    }


def _decode_entry(p: DecodePoint) -> dict:
    return {"total_kv_read_tokens": p.total_kv_read_tokens, "batch_size": p.batch_size}
