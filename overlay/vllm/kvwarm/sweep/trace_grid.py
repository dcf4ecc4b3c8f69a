"""The grid a sweep measures from a served-step trace (`--grid-from TRACE`, or "grid_from" in
the sweep's config): points laid over the shapes the deployment actually ran, so that the
table predicts every traced step without extrapolating (record.validate.predict's coverage).

  decode   the batch axis spans the traced decode batches: both ends, every decode capture
           size inside with its C + 1 (the graph boundaries, sweep.grid's pairs, never
           broken), then every traced batch where they fit the cap, else quantiles of the
           steps' batches (density where steps are frequent).
           Per batch a KV axis the same way over the contexts of the steps that read that
           batch's curve (those between its neighbours, scaled to it at equal context per
           request), from 2B to the deepest the pool and max_model_len allow.
  prefill  a few batch sizes over the traced prefill batches; per batch the new-token axis
           (ends, prefill capture sizes with C + 1, quantiles) and the prefix axis per
           request in whole prefix blocks (shallowest rounded down, deepest up), crossed;
           each axis as the batch axis: ends, boundaries, every value or quantiles.
           Steps whose every prefill chunk continues its prompt get continuation points of
           their own, laid the same way over them alone (at least one prefix block each),
           where the engine can measure them (GridLimits.continuations); elsewhere they
           join the other prefill steps.
  mixed    a mixed step's decode part joins the decode shapes and its prefill part the
           prefill shapes (the composed prediction reads both), and mixed points are laid
           over the mixed steps: the decode part's batch axis and, per batch, its KV axis
           as decode's (without capture sizes: a mixed step's graph goes by its tokens),
           crossed with the prefill part's batch and prefix axes as prefill's and the
           step's tokens (T = N + the decode batch: the axis validate reads mixed rows
           along, since chunked prefill fills the budget whatever the decode batch; a
           decode batch past what max_num_seqs leaves beside a prefill batch gives way to
           the widest that fits),
           a prefix too deep for max_model_len gives way to the deepest that fits, and the
           rungs are held to the pool as --grid's (sweep.grid.lay_mixed). None where the
           engine cannot measure mixed points (sweep.grid.mixed_note). Mixed steps whose
           every prefill chunk continues its prompt get continuation mixed points of their
           own where the engine measures continuations, as prefill steps do.

Each axis is capped (TRACE_CAPS; "grid_caps" in the config sets them; "mixed" caps each of
the mixed points' five axes). The points the engine cannot run as one step are left out by
the same checks as --grid (sweep.run). A trace of
another model, layout or step-time setting is refused: before the engine loads where the
command's arguments tell (`check_given`), and once it is up against everything the engine
resolved (`check_engine`), so the table made here is one `validate` accepts.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..record.shape import GraphConfig
from ..record.trace.reader import MIXED, Step, Trace, TraceError, read_trace
from ..record.validate.match import Provenance, loop_refusal, match, model_name, refusal
from .grid import (
    GridLimits,
    axis,
    deepest_kv,
    feasible_batch,
    lay_mixed,
    mixed_batch_limit,
    mixed_deepest,
    mixed_note,
    thin,
)
from .grid_settings import check_bounds
from .plan import CHAIN_DEPTH_MARGIN
from .points import DecodePoint, MixedPoint, PrefillPoint
from .settings import SettingsError

TRACE_CAPS = {
    "decode_batches": 12,
    "kv_ladder": 6,
    "prefill_batches": 3,
    "prefill_tokens": 8,
    "prefix_depths": 4,
    "mixed": 2,
}
# Each cap's bound: the decode grid is decode_batches x kv_ladder points (at most 65,536), the
# prefill grid prefill_batches x prefill_tokens x prefix_depths (at most 65,536, twice with
# continuations), and "mixed" caps each of the mixed points' five axes, so up to mixed^5
# candidates (6: 7,776; 7 would be 16,807). Beyond them: write a points file.
TRACE_CAP_BOUNDS = {
    "decode_batches": 256,
    "kv_ladder": 256,
    "prefill_batches": 16,
    "prefill_tokens": 256,
    "prefix_depths": 16,
    "mixed": 6,
}
MIXED_AXES = 5  # decode batch, context, prefill batch, step tokens, prefix depth


@dataclass
class Shapes:
    """The shapes a trace's steps ran, each with how many steps ran it (not the steps)."""

    decode: Counter = field(default_factory=Counter)  # (B, K) per decode step and per mixed step's decode part
    prefill: Counter = field(default_factory=Counter)  # (B, N, P) per prefill step and mixed step's prefill part
    mixed: Counter = field(default_factory=Counter)  # (B, K, B, N, P) per mixed step
    continued: Counter = field(default_factory=Counter)  # (B, N, P) of the prefill parts whose every chunk continues
    mixed_continued: Counter = field(default_factory=Counter)  # the mixed steps among them

    def add(self, s: Step) -> None:
        if s.spec_tokens:  # a draft-token step is no table's shape
            return
        d = (s.decode_requests, s.decode_kv_tokens)
        p = (s.prefill_requests, s.prefill_new_tokens, s.prefill_prefix_tokens)
        if s.decode_requests:
            self.decode[d] += 1
        if s.prefill_requests:
            (self.continued if s.continues else self.prefill)[p] += 1
        if s.kind == MIXED:
            (self.mixed_continued if s.continues else self.mixed)[(*d, *p)] += 1


def shapes(steps: Iterable[Step]) -> Shapes:
    found = Shapes()
    for s in steps:
        found.add(s)
    return found


def _tally(counted: Iterable[tuple[int, int]]) -> Counter:
    """(value, steps) pairs summed per value."""
    tally = Counter()
    for value, count in counted:
        tally[value] += count
    return tally


def spread(values: Iterable[int] | Mapping[int, int], sizes: tuple[int, ...], lo: int, hi: int, cap: int) -> list[int]:
    """An axis over `values` (each clamped to [lo, hi]; a list, or counts: value -> steps):
    both ends, the capture sizes inside with their C + 1 (pairs kept whole), then every value
    where they all fit in `cap`, else quantiles of the values (each counted as often as it
    was run) up to it."""
    counts = _tally(values.items() if isinstance(values, Mapping) else ((x, 1) for x in values))
    counts = _tally((min(max(x, lo), hi), n) for x, n in counts.items())
    distinct = sorted(counts)
    first, last = distinct[0], distinct[-1]
    picked = {first, last}
    if sizes and last > first:
        laid = axis(tuple(sizes), last, floor=first)
        bounds = [x for x in laid.values if x in sizes or x - 1 in sizes]
        if bounds:
            picked |= set(thin(bounds, laid.pairs, max(2, cap - 2)))
    if len(picked | set(distinct)) <= cap:
        return sorted(picked | set(distinct))
    room = cap - len(picked)
    below = list(itertools.accumulate(counts[x] for x in distinct))  # the values at or below each
    total = below[-1]
    for i in range(1, room + 1):  # the value at this place of the values in order
        picked.add(distinct[bisect.bisect_right(below, round(i * (total - 1) / (room + 1)))])
    return sorted(picked)


def _near(axis_values: list[int], i: int, b: int) -> bool:
    """Whether a step of b requests reads the curve of axis_values[i] (between its neighbours)."""
    below = axis_values[i - 1] if i else 0
    above = axis_values[i + 1] if i + 1 < len(axis_values) else math.inf
    return below < b < above


def decode_points(found: Shapes, graphs: GraphConfig, limits: GridLimits, caps: dict) -> list[DecodePoint]:
    if not found.decode:
        return []
    widest = feasible_batch(graphs, limits)
    runs = _tally((b, n) for (b, _), n in found.decode.items())
    batches = spread(runs, graphs.decode_capture_sizes, 1, widest, caps["decode_batches"])
    points = []
    for i, batch in enumerate(batches):
        contexts = _tally((round(k * batch / b), n) for (b, k), n in found.decode.items() if _near(batches, i, b))
        deepest = deepest_kv(batch, limits)
        if contexts and deepest >= 2 * batch:
            points += [DecodePoint(k, batch) for k in spread(contexts, (), 2 * batch, deepest, caps["kv_ladder"])]
    return points


def _fits(point: PrefillPoint, limits: GridLimits) -> bool:
    return point.tokens_spanned(limits.prefix_unit) <= limits.max_model_len - CHAIN_DEPTH_MARGIN


def prefill_points(
    found: Counter, graphs: GraphConfig, limits: GridLimits, caps: dict, continuation: bool = False
) -> list[PrefillPoint]:
    """Prefill points over the (B, N, P) of `found` (each with its steps); `continuation`:
    continuation points, each request's prefix at least one block (what a lead step computes)."""
    if not found:
        return []
    unit = limits.prefix_unit
    batches = spread(
        _tally((b, c) for (b, _, _), c in found.items()), (), 1, graphs.max_num_seqs, caps["prefill_batches"]
    )
    points = []
    for i, batch in enumerate(batches):
        near = [(n * batch / b, p / b / unit, c) for (b, n, p), c in found.items() if _near(batches, i, b)]
        if not near or (continuation and not _leads_fit(batch, graphs, limits)):
            continue
        tokens = spread(
            _tally((round(n), c) for n, _, c in near),
            graphs.prefill_capture_sizes,
            batch,
            graphs.max_num_batched_tokens,
            caps["prefill_tokens"],
        )
        blocks = [(max(u, continuation), c) for _, u, c in near]
        shallow, deep = math.floor(min(u for u, _ in blocks)), math.ceil(max(u for u, _ in blocks))
        rounded = _tally((round(u), c) for u, c in blocks)
        depths = set(spread(rounded, (), shallow, deep, caps["prefix_depths"])) | {shallow, deep}
        for n in tokens:
            laid = [PrefillPoint(n, u * unit * batch, batch, continuation) for u in sorted(depths)]
            fitting = [p for p in laid if _fits(p, limits)]
            if len(fitting) < len(laid):  # the deepest prefix that still fits stands in for the rest
                room = (limits.max_model_len - CHAIN_DEPTH_MARGIN - 1 - math.ceil(n / batch)) // unit
                deepest = PrefillPoint(n, room * unit * batch, batch, continuation)
                if room > 0 and _fits(deepest, limits) and deepest not in fitting:
                    fitting.append(deepest)
            points += fitting
    return points


def _leads_fit(batch: int, graphs: GraphConfig, limits: GridLimits) -> bool:
    """Whether a continuation shot of `batch` requests has its lead step (a prefix block each) in one step."""
    return batch * limits.prefix_unit <= graphs.max_num_batched_tokens


def mixed_points(
    found: Counter,
    graphs: GraphConfig,
    limits: GridLimits,
    caps: dict,
    continuation: bool = False,
) -> list[MixedPoint]:
    """Mixed points over the traced mixed steps `found` ((B, K, B, N, P), each with its steps): the decode
    parts' (B, K) axes crossed with the prefill parts' batch and prefix axes and the steps'
    tokens T = N + decode batch (a point's N is T less its decode batch: steps that fill the
    budget share T = max_num_batched_tokens), each spread over what the mixed steps ran within
    caps["mixed"] values; a prefix too deep for max_model_len gives way to the deepest that
    fits; none where mixed points cannot run. `continuation`: continuation parts, each
    request's prefix at least one block."""
    widest = mixed_batch_limit(graphs, limits)
    if not found or mixed_note(limits) is not None or widest < 1:
        return []
    cap, unit, budget = caps["mixed"], limits.prefix_unit, graphs.max_num_batched_tokens
    room = limits.max_model_len - CHAIN_DEPTH_MARGIN  # a request's tokens, its sampled one among them
    decode = []
    batches = spread(_tally((m[0], c) for m, c in found.items()), (), 1, widest, cap)
    for i, batch in enumerate(batches):
        contexts = _tally((round(k * batch / b), c) for (b, k, *_), c in found.items() if _near(batches, i, b))
        deepest = mixed_deepest(batch, graphs, limits)
        if contexts and deepest >= 2 * batch:
            decode += [(batch, k) for k in spread(contexts, (), 2 * batch, deepest, cap)]
    candidates = []
    batches = spread(_tally((m[2], c) for m, c in found.items()), (), 1, graphs.max_num_seqs - 1, cap)
    for i, batch in enumerate(batches):
        # The step's tokens T (its chunk and its decodes), equal across prefill batch sizes:
        # the axis the predictor reads mixed rows along (record.validate.predict).
        near = [(n + d, p / b / unit, c) for (d, _, b, n, p), c in found.items() if _near(batches, i, b)]
        if not near or (continuation and not _leads_fit(batch, graphs, limits)):
            continue
        blocks = [(max(u, continuation), c) for _, u, c in near]  # the ends rounded outwards, as prefill's
        shallow, deep = math.floor(min(u for u, _ in blocks)), math.ceil(max(u for u, _ in blocks))
        depths = spread(_tally([(shallow, 1), (deep, 1), *((round(u), c) for u, c in blocks)]), (), shallow, deep, cap)
        beside = _decode_beside(decode, batch, graphs.max_num_seqs)
        for t in spread(_tally((round(t), c) for t, _, c in near), (), batch + 1, budget, cap):
            for u in depths:
                for b, k in beside:
                    fill = t - b  # the chunk beside b decodes in a step of t tokens
                    top = (room - 1 - math.ceil(fill / batch)) // unit  # the deepest prefix beside it, in blocks
                    if fill >= batch and min(u, top) >= continuation:
                        part = PrefillPoint(fill, min(u, top) * unit * batch, batch, continuation)
                        candidates.append(MixedPoint(DecodePoint(k, b), part))
    return lay_mixed(candidates, graphs, limits)


def _decode_beside(decode: list[tuple[int, int]], batch: int, max_num_seqs: int) -> list[tuple[int, int]]:
    """The decode parts beside a prefill part of `batch` requests: a batch past what
    max_num_seqs leaves gives way to the widest that fits, at equal context per request, so
    that every prefill batch's rows still span the decode batches its steps can hold."""
    widest = max_num_seqs - batch
    fitted = [(min(b, widest), round(k * min(b, widest) / b)) for b, k in decode if widest >= 1]
    return list(dict.fromkeys(fitted))


def caps_of(asked) -> dict:
    """TRACE_CAPS with the ones asked for ("grid_caps": {name: positive int}, each within its
    bound: TRACE_CAP_BOUNDS)."""
    asked = asked or {}
    ok = isinstance(asked, dict) and set(asked) <= set(TRACE_CAPS)
    if not ok or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in asked.values()):
        raise SettingsError(f"grid caps {asked!r}: a JSON object of positive integers among {', '.join(TRACE_CAPS)}")
    five = {
        "mixed": lambda cap: f"it caps each of {MIXED_AXES} axes: up to {cap}^{MIXED_AXES} = {cap**MIXED_AXES:,} points"
    }
    check_bounds(asked, TRACE_CAP_BOUNDS, f'grid caps (--grid-caps, "grid_caps") {asked!r}', five)
    return {**TRACE_CAPS, **asked}


def trace_grid(found: Shapes, graphs: GraphConfig, limits: GridLimits, asked_caps=None) -> list:
    """Every point laid over a trace's shapes (prefill first, as a sweep runs them)."""
    caps = caps_of(asked_caps)
    if limits.continuations:
        prefill = prefill_points(found.prefill, graphs, limits, caps)
        prefill += prefill_points(found.continued, graphs, limits, caps, continuation=True)
        mixed = mixed_points(found.mixed, graphs, limits, caps)
        mixed += mixed_points(found.mixed_continued, graphs, limits, caps, continuation=True)
    else:
        prefill = prefill_points(found.prefill + found.continued, graphs, limits, caps)
        mixed = mixed_points(found.mixed + found.mixed_continued, graphs, limits, caps)
    return prefill + decode_points(found, graphs, limits, caps) + mixed


def read_shapes(trace_dir, seconds=0.0) -> tuple[Trace, Shapes]:
    """A trace's headers, and the shapes of its steps but those that ended within its first
    `seconds` (--skip-seconds, "grid_skip_seconds": a fresh server's warm-up, one short request
    of every length, which would spread the prefill axes over prompts the deployment does not
    serve; validate --skip-seconds leaves the same steps out). Read line by line: the trace's
    steps are counted per shape, never held."""
    what = f'--skip-seconds ("grid_skip_seconds") {seconds!r}'
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise SettingsError(f"{what}: give the seconds of the trace to leave out, 0 or more")
    found, last, kept = Shapes(), [0.0], [0]

    def keep(step: Step) -> None:
        last[0] = max(last[0], step.at)
        if step.at >= seconds:
            kept[0] += 1
            found.add(step)

    trace = read_trace(trace_dir, keep)
    if not kept[0]:
        raise TraceError(
            f"{what}: leaves none of the {trace.step_count} steps of {trace.root} (the last ended {last[0]:.1f} s "
            "into it); give fewer seconds"
        )
    return trace, found


def check_given(trace_dir: str, engine_args, skip_seconds=0.0) -> tuple[Trace, Shapes]:
    """Before the engine loads: the trace read (less its first `skip_seconds`: read_shapes),
    and refused where the command's engine arguments (vLLM's EngineArgs) already differ from
    what the trace ran with."""
    trace, found = read_shapes(trace_dir, skip_seconds)
    ran = Provenance.of_trace(trace.header)
    given = {
        "model": model_name(engine_args.model),
        "tensor_parallel_size": engine_args.tensor_parallel_size,
        "data_parallel_size": engine_args.data_parallel_size,
        "pipeline_parallel_size": engine_args.pipeline_parallel_size,
        "expert_parallel": bool(engine_args.enable_expert_parallel),
        "max_num_batched_tokens": engine_args.max_num_batched_tokens,  # None: not given
    }
    traced = {"model": ran.model, **ran.layout, "max_num_batched_tokens": ran.resolved.get("max_num_batched_tokens")}
    differ = [
        f"{name} (trace {traced[name]!r}, given {value!r})"
        for name, value in given.items()
        if value is not None and traced.get(name) is not None and traced[name] != value
    ]
    if differ:
        raise TraceError(
            f"--grid-from {trace.root}: the trace ran another engine: {'; '.join(differ)}; sweep with the "
            f"arguments the trace ran with (its header's engine.given: {ran_given(trace)})"
        )
    return trace, found


def ran_given(trace: Trace) -> str:
    given = (trace.header.get("engine") or {}).get("given")
    return " ".join(map(str, given)) if isinstance(given, list) else "not recorded"


def check_engine(trace: Trace, run: dict, layout: dict, model: str) -> None:
    """Once the engine is up: everything that changes a step's time equal to the trace's,
    and the same engine loop (record.validate.match), else the sweep is refused."""
    engine = Provenance.of_artifact(
        {"config": {"model": model, "engine_args": run.get("engine_args")}, "layout": layout, **run}
    )
    m = match(Provenance.of_trace(trace.header), engine)
    what = f"--grid-from {trace.root}: the trace and this engine"
    fix = f"Start the sweep with the arguments the trace ran with ({ran_given(trace)}) on its build and hardware."
    problem = refusal(what, m, fix, "engine") or loop_refusal(
        what, m, "Sweep under the trace's loop: --async-scheduling or --no-async-scheduling.", "engine"
    )
    if problem:
        raise TraceError(problem)
