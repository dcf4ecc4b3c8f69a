"""The grid a sweep measures when no points file is given (`--grid`, or "grid": true): points
laid around the engine's CUDA-graph capture sizes (sweep.graphs), where step time jumps.

  decode   batch axis: every decode capture size C up to the feasible maximum and C + 1
           (the first batch that falls into the next graph), a doubling eager tail past the
           largest, and the limit; with no capture sizes, powers of two and the limit. Per
           batch a KV ladder: 2B (the shallowest a shadow is admitted at: one token short of
           a 2-token context), powers of two, the deepest the pool and max_model_len allow.
  prefill  new-token axis from the prefill capture sizes the same way (up to
           max_num_batched_tokens), at small batch sizes and a few prefix depths (none, a
           quarter and a half of max_model_len per request, in whole prefix blocks).

Each axis is thinned to a cap (CAPS; "grid": {...} in the sweep's config sets them) by whole
C / C + 1 pairs, so no pair is ever broken. The grid is a points file (schema v1), written
beside the artifact for the user to edit and pass back.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..record.shape import GraphConfig
from .plan import CHAIN_DEPTH_MARGIN
from .points import DecodePoint, PrefillPoint

PREFILL_BATCHES = (1, 4)
CAPS = {"decode_batches": 12, "kv_ladder": 6, "prefill_tokens": 10}


@dataclass(frozen=True)
class GridLimits:
    max_model_len: int
    steady_steps: int
    kv_cache_tokens: int  # tokens the pool holds
    num_blocks: int
    block_size: int  # the attention block size
    prefix_unit: int  # a prefix is whole blocks of this


def axis(sizes: tuple[int, ...], limit: int, floor: int = 1) -> tuple[list[int], set[tuple[int, int]]]:
    """Capture sizes up to `limit`, each with its C + 1, a doubling tail, the limit (no sizes:
    powers of two); and the C / C + 1 pairs in it."""
    sizes = [s for s in sizes if floor <= s <= limit]
    if sizes:
        values = set(sizes) | {s + 1 for s in sizes if s + 1 <= limit}
        tail = 2 * max(sizes)
        while tail < limit:
            values.add(tail)
            tail *= 2
    else:
        values = {1 << k for k in range(limit.bit_length()) if floor <= 1 << k <= limit}
    values.add(limit)
    pairs = {(s, s + 1) for s in sizes if s + 1 in values}
    return sorted(values), pairs


def thin(values: list[int], pairs: set[tuple[int, int]], cap: int) -> list[int]:
    """At most about `cap` values, evenly spread, first and last kept, pairs whole."""
    units, paired = [], {b for _, b in pairs}
    for value in values:
        if value in paired and units and units[-1][-1] == value - 1:
            units[-1].append(value)
        else:
            units.append([value])
    if sum(len(u) for u in units) <= cap or len(units) <= 2:
        return values
    keep = max(2, cap // 2)
    picked = sorted({round(i * (len(units) - 1) / (keep - 1)) for i in range(keep)})
    return [value for i in picked for value in units[i]]


def _ladder(batch: int, deepest: int, cap: int) -> list[int]:
    rungs = {2 * batch, deepest} | {1 << k for k in range(deepest.bit_length()) if 2 * batch < 1 << k < deepest}
    values = sorted(rungs)
    return thin(values, set(), cap)


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
    batches, pairs = axis(graphs.decode_capture_sizes, feasible_batch(graphs, limits))
    points = []
    for batch in thin(batches, pairs, caps["decode_batches"]):
        deepest = deepest_kv(batch, limits)
        if deepest >= 2 * batch:
            points += [DecodePoint(k, batch) for k in _ladder(batch, deepest, caps["kv_ladder"])]
    return points


def prefill_grid(graphs: GraphConfig, limits: GridLimits, caps: dict = CAPS) -> list[PrefillPoint]:
    points = []
    unit = limits.prefix_unit
    for batch in (b for b in PREFILL_BATCHES if b <= graphs.max_num_seqs):
        tokens, pairs = axis(graphs.prefill_capture_sizes, graphs.max_num_batched_tokens, floor=batch)
        depths = sorted({0, *(unit * (limits.max_model_len // (f * unit)) for f in (4, 2))})
        for n in thin(tokens, pairs, caps["prefill_tokens"]):
            for depth in depths:
                if depth and depth < unit:
                    continue
                point = PrefillPoint(n, depth * batch, batch)
                if point.tokens_spanned(unit) <= limits.max_model_len - CHAIN_DEPTH_MARGIN:
                    points.append(point)
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
