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

Each axis is thinned to a cap of values (CAPS; "grid": {...} in the sweep's config sets
them) on a log scale (`thin`): its first unit, its doubling tail and its limit are always
kept, and C / C + 1 pairs are kept or dropped whole. The grid is a points file (schema v1),
written beside the artifact for the user to edit and pass back.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..record.shape import GraphConfig
from .plan import CHAIN_DEPTH_MARGIN
from .points import DecodePoint, PrefillPoint

PREFILL_BATCHES = (1, 4)
CAPS = {"decode_batches": 12, "kv_ladder": 6, "prefill_tokens": 16}


@dataclass(frozen=True)
class GridLimits:
    max_model_len: int
    steady_steps: int
    kv_cache_tokens: int  # tokens the pool holds
    num_blocks: int
    block_size: int  # the attention block size
    prefix_unit: int  # a prefix is whole blocks of this


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


def _ladder(batch: int, deepest: int, cap: int) -> list[int]:
    rungs = {2 * batch, deepest} | {1 << k for k in range(deepest.bit_length()) if 2 * batch < 1 << k < deepest}
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
    return min(batch * per_request, int(0.8 * limits.kv_cache_tokens) - 2 * batch * limits.block_size)


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


def points_file(points: list) -> dict:
    """The grid as a points file (schema v1)."""
    return {
        "schema_version": 1,
        "prefill": [
            {
                "total_prefill_tokens": p.total_prefill_tokens,
                "total_kv_read_tokens": p.total_kv_read_tokens,
                "batch_size": p.batch_size,
            }
            for p in points
            if isinstance(p, PrefillPoint)
        ],
        "decode": [
            {"total_kv_read_tokens": p.total_kv_read_tokens, "batch_size": p.batch_size}
            for p in points
            if isinstance(p, DecodePoint)
        ],
    }
