"""The one predictor `validate` holds a table against a trace with (docs/validate-reference.md):

  decode   piecewise linear in K along each measured batch size B; between two measured
           batch sizes linear in B at equal context per request (the step of b requests and
           K tokens is read at K * B / b on each neighbour's curve)
  prefill  the same over (N, P): piecewise linear in N along each measured (B, P); between
           two measured P of one B linear in P; between batch sizes linear in B at equal new
           and prefix tokens per request
  mixed    from measured mixed rows where the table has them (the prefill part located as a
           prefill step is, but along the step's scheduled tokens T = N + decode batch in
           place of N, and between prefill batch sizes at equal T: each node a decode
           surface over the decode part), else
           composed as planners compose it: the prefill part's prediction plus the decode
           part's marginal over the decode curve's baseline (its least-work measured row)

Beyond the measured range on any axis the nearest segment is extended linearly (never below
0) and the prediction is outside the table's range: `inside` says whether it needed no
extrapolation at all (coverage). Rows measured twice count with their median.

Continuation rows (a prefill row, or a mixed row's prefill part, whose requests were running
ones: sweep-reference.md#continuation-points) form surfaces of their own: a step whose every prefill
chunk continues its prompt is predicted from them where the table has them, else from the
rows of new requests, as every other step is.

Each row gives a value on the basis chosen (BASES): `step`, the whole window from one update
end to the next (a decode row's own sample; a prefill row's phases summed, since its samples
time the forward alone), or `forward`, the forward phase (a decode row's phase, a prefill
row's own sample). Plain data: nothing here imports vLLM.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from .. import vocabulary as v
from ..runs import ReportError, Row, read_rows
from ..shape import CONTINUATION, is_continuation

STEP, FORWARD = "step", "forward"
BASES = (STEP, FORWARD)
MEASURED, COMPOSED = "measured", "composed"  # how a prediction was made
MIXED = v.MIXED  # the point_type of a mixed row


@dataclass(frozen=True)
class Estimate:
    ms: float
    inside: bool  # no extrapolation was needed


@dataclass(frozen=True)
class MixedRow:
    """A measured mixed step: decode requests and prefill requests in one step."""

    decode_b: int
    decode_k: int
    prefill_b: int
    prefill_n: int
    prefill_p: int
    median_ms: float | None  # the step basis (None: its phases were not all recorded)
    phases_ms: dict[str, float]
    continuation: bool = False  # its prefill part's requests were running ones


@dataclass(frozen=True)
class Prediction:
    ms: float
    inside: bool
    how: str  # MEASURED or COMPOSED


Node = tuple[float, Callable[[], Estimate | None]]


def along(nodes: list[Node], x: float) -> Estimate | None:
    """Linear in x between the two nodes around it (each node's value computed on demand);
    beyond the ends the nearest two nodes' line, never below 0; one node: its value. Outside
    the nodes' range the estimate is not inside."""
    nodes = sorted(nodes, key=lambda n: n[0])
    if not nodes:
        return None
    for at, value in nodes:
        if at == x:
            return value()
    if len(nodes) == 1:
        only = nodes[0][1]()
        return None if only is None else Estimate(only.ms, False)
    if nodes[0][0] < x < nodes[-1][0]:
        i = next(i for i, (at, _) in enumerate(nodes) if at > x)
        (x0, f0), (x1, f1), outside = nodes[i - 1], nodes[i], False
    elif x < nodes[0][0]:
        (x0, f0), (x1, f1), outside = nodes[0], nodes[1], True
    else:
        (x0, f0), (x1, f1), outside = nodes[-2], nodes[-1], True
    a, b = f0(), f1()
    if a is None or b is None:
        return None
    ms = a.ms + (b.ms - a.ms) * (x - x0) / (x1 - x0)
    return Estimate(max(0.0, ms), a.inside and b.inside and not outside)


def _leaf(ms: float) -> Callable[[], Estimate]:
    return lambda: Estimate(ms, True)


def _median_by(items: list[tuple[tuple, float]]) -> dict[tuple, float]:
    """Each key's value: the median where a point was measured more than once."""
    grouped: dict[tuple, list[float]] = {}
    for key, ms in items:
        grouped.setdefault(key, []).append(ms)
    return {key: statistics.median(values) for key, values in grouped.items()}


class DecodeSurface:
    def __init__(self, points: dict[tuple[int, int], float]):
        """points: (B, K) -> ms."""
        self.curves: dict[int, list[tuple[int, float]]] = {}
        for (b, k), ms in sorted(points.items()):
            self.curves.setdefault(b, []).append((k, ms))

    def __bool__(self) -> bool:
        return bool(self.curves)

    def at(self, b: int, k: float) -> Estimate | None:
        def curve(batch: int) -> Callable[[], Estimate | None]:
            return lambda: along([(kk, _leaf(ms)) for kk, ms in self.curves[batch]], k * batch / b)

        return along([(batch, curve(batch)) for batch in self.curves], b)

    def baseline(self) -> float:
        """The least-work measured step: the smallest batch's shallowest row."""
        return self.curves[min(self.curves)][0][1]


class PrefillSurface:
    """Nodes keyed by (B, P, N), each holding a value or another surface (mixed rows)."""

    def __init__(self, nodes: dict[tuple[int, int, int], Callable[..., Estimate | None]]):
        self.nodes: dict[int, dict[int, list[tuple[int, Callable]]]] = {}
        for (b, p, n), leaf in sorted(nodes.items(), key=lambda item: item[0]):
            self.nodes.setdefault(b, {}).setdefault(p, []).append((n, leaf))

    def __bool__(self) -> bool:
        return bool(self.nodes)

    def at(self, b: int, n: float, p: float, *leaf_args, per_request: bool = True) -> Estimate | None:
        """`per_request`: between batch sizes at equal new tokens per request (prefill rows);
        else at equal tokens `n` (a mixed surface's step tokens: one budget, shared)."""

        def curve(batch: int, prefix: int) -> Callable[[], Estimate | None]:
            scale = batch / b if per_request else 1.0
            nodes = [(nn, lambda leaf=leaf: leaf(*leaf_args)) for nn, leaf in self.nodes[batch][prefix]]
            return lambda: along(nodes, n * scale)

        def at_batch(batch: int) -> Callable[[], Estimate | None]:
            return lambda: along([(pp, curve(batch, pp)) for pp in self.nodes[batch]], p * batch / b)

        return along([(batch, at_batch(batch)) for batch in self.nodes], b)


def row_value(row: Row, basis: str) -> float | None:
    """A decode or prefill row's value on the basis (None where the row lacks it)."""
    phases = row.phases_ms
    if row.kind == v.PREFILL:
        if basis == FORWARD:
            return row.median_ms
        return sum(phases[p] for p in v.PHASES) if all(p in phases for p in v.PHASES) else None
    return row.median_ms if basis == STEP else phases.get("forward")


def read_mixed_rows(artifact: dict, source: str = "the table") -> list[MixedRow]:
    """The artifact's measured mixed rows: point {"point_type": "mixed", "decode":
    {batch_size, total_kv_read_tokens}, "prefill": {batch_size, total_prefill_tokens,
    total_kv_read_tokens}} (and the step's totals, as other rows have them), median_seconds and
    phases. A row whose samples time its shot's forward (sample_kind shot_forward, as the
    sweep's mixed rows do) is read as a prefill row is: its step is its phases summed (None
    where one lacks), its forward its median. A row without those fields (hand-edited, or
    older than mixed points) is refused by name (ReportError), as runs.read_rows refuses one."""
    rows = []
    for i, r in enumerate(artifact.get("results") or []):
        point = r.get("point") if isinstance(r, dict) else None
        if not isinstance(point, dict) or point.get("point_type") != MIXED:
            continue
        d, p = point.get("decode"), point.get("prefill")
        counts = [
            (d, "batch_size"),
            (d, "total_kv_read_tokens"),
            (p, "batch_size"),
            (p, "total_prefill_tokens"),
            (p, "total_kv_read_tokens"),
        ]
        if not all(isinstance(part, dict) and _count(part.get(name)) for part, name in counts) or not _seconds(
            r.get("median_seconds")
        ):
            raise ReportError(
                f"{source}: results[{i}]: not a measured mixed row (it needs point.decode.batch_size and "
                "total_kv_read_tokens, point.prefill.batch_size, total_prefill_tokens and total_kv_read_tokens, "
                "and median_seconds); the file was not written by the sweep or was edited: sweep the mixed "
                "points again, or remove the row"
            )
        recorded = r.get("phases") if isinstance(r.get("phases"), dict) else {}
        phases = {name: t * 1e3 for name, t in recorded.items() if _seconds(t)}
        median_ms = r["median_seconds"] * 1e3
        if r.get("sample_kind") == v.SHOT_FORWARD:
            median_ms, phases = (
                sum(phases[name] for name in v.PHASES) if all(name in phases for name in v.PHASES) else None,
                {**phases, "forward": median_ms},
            )
        rows.append(
            MixedRow(
                d["batch_size"],
                d["total_kv_read_tokens"],
                p["batch_size"],
                p["total_prefill_tokens"],
                p["total_kv_read_tokens"],
                median_ms,
                phases,
                is_continuation(point),
            )
        )
    return rows


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def read_continuation_rows(artifact: dict, source: str) -> list[Row]:
    """The artifact's measured continuation prefill rows, read as plain prefill rows are."""
    results = [
        {**r, "point": {key: x for key, x in r["point"].items() if key != CONTINUATION}}
        for r in artifact.get("results") or []
        if isinstance(r, dict)
        and isinstance(r.get("point"), dict)
        and r["point"].get("point_type") == v.PREFILL
        and is_continuation(r["point"])
    ]
    return read_rows({**artifact, "results": results}, source) if results else []


class Predictor:
    """A table's rows as surfaces on one basis."""

    def __init__(self, rows: list[Row], mixed: list[MixedRow], basis: str = STEP, continued: list[Row] = ()):
        """`continued`: the continuation prefill rows (read_continuation_rows)."""
        if basis not in BASES:
            raise ValueError(f"basis {basis!r} is none of {', '.join(BASES)}")
        self.basis = basis
        valued = [(r, row_value(r, basis)) for r in rows]
        self.decode = DecodeSurface(
            _median_by([((r.b, r.k), ms) for r, ms in valued if r.kind == v.DECODE and ms is not None])
        )
        self.prefill = _prefill_surface(valued)
        self.continued = _prefill_surface([(r, row_value(r, basis)) for r in continued])
        self.mixed = _mixed_surface([m for m in mixed if not m.continuation], basis)
        self.mixed_continued = _mixed_surface([m for m in mixed if m.continuation], basis)

    def kinds(self) -> dict[str, str | None]:
        """How each step kind is predicted: MEASURED, COMPOSED, or None (not covered)."""
        composed = COMPOSED if self.decode and self.prefill else None
        return {
            v.DECODE: MEASURED if self.decode else None,
            v.PREFILL: MEASURED if self.prefill else None,
            MIXED: MEASURED if self.mixed or self.mixed_continued else composed,
        }

    def decode_step(self, b: int, k: int) -> Prediction | None:
        est = self.decode.at(b, k) if self.decode else None
        return None if est is None else Prediction(est.ms, est.inside, MEASURED)

    def prefill_step(self, b: int, n: int, p: int, continuation: bool = False) -> Prediction | None:
        surface = self.continued if continuation and self.continued else self.prefill
        est = surface.at(b, n, p) if surface else None
        return None if est is None else Prediction(est.ms, est.inside, MEASURED)

    def mixed_step(
        self, decode_b: int, decode_k: int, prefill_b: int, prefill_n: int, prefill_p: int, continuation: bool = False
    ):
        surface = self.mixed_continued if continuation and self.mixed_continued else self.mixed
        if surface:
            est = surface.at(prefill_b, prefill_n + decode_b, prefill_p, decode_b, decode_k, per_request=False)
            return None if est is None else Prediction(est.ms, est.inside, MEASURED)
        return self.composed_step(decode_b, decode_k, prefill_b, prefill_n, prefill_p, continuation)

    def composed_step(
        self, decode_b: int, decode_k: int, prefill_b: int, prefill_n: int, prefill_p: int, continuation: bool = False
    ):
        """A mixed step as planners compose it from the pure rows (also where mixed rows exist:
        validate prints it beside the measured prediction)."""
        prefill = self.prefill_step(prefill_b, prefill_n, prefill_p, continuation)
        decode = self.decode_step(decode_b, decode_k)
        if prefill is None or decode is None:
            return None
        marginal = max(0.0, decode.ms - self.decode.baseline())
        return Prediction(prefill.ms + marginal, prefill.inside and decode.inside, COMPOSED)


def _prefill_surface(valued: list[tuple[Row, float | None]]) -> PrefillSurface:
    prefill = _median_by([((r.b, r.k, r.n), ms) for r, ms in valued if r.kind == v.PREFILL and ms is not None])
    return PrefillSurface({key: _leaf(ms) for key, ms in prefill.items()})


def _mixed_surface(mixed: list[MixedRow], basis: str) -> PrefillSurface:
    """Mixed rows located by their prefill part's batch and prefix and the step's scheduled
    tokens (T = N + decode batch), each node a decode surface over the decode part. Keyed by
    T, not N: chunked prefill fills a step's budget, so the mixed steps a server runs, and the
    rows the grids lay for them, share T = max_num_batched_tokens across decode batches, where
    each decode batch has an N of its own (N-keyed, no node would hold two decode batches);
    for the same reason a step between two prefill batch sizes is read at its own T on each,
    not at equal tokens per request (which would pass the budget)."""
    by_prefill: dict[tuple[int, int, int], list[tuple[tuple, float]]] = {}
    for m in mixed:
        ms = m.median_ms if basis == STEP else m.phases_ms.get("forward")
        if ms is not None:
            key = (m.prefill_b, m.prefill_p, m.prefill_n + m.decode_b)
            by_prefill.setdefault(key, []).append(((m.decode_b, m.decode_k), ms))
    surfaces = {key: DecodeSurface(_median_by(items)) for key, items in by_prefill.items()}
    return PrefillSurface({key: surface.at for key, surface in surfaces.items()})
