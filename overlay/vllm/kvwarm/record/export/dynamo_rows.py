"""A sweep's rows in Dynamo's self-benchmark artifact, for one kind of point: the points
measured on every rank (`points_over_ranks`), each as Dynamo's point with the graph it should
run in, one ForwardPassMetrics per rank, the iteration groups, and the skipped points; or for
both kinds in one artifact, as Dynamo's agg mode runs them (`agg_rows`: the prefill points,
then the decode points, numbered on).

Plain data: nothing here imports vLLM.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .. import vocabulary as v
from ..shape import balanced, expected_graph, is_continuation, point_key, step_tokens

NAMESPACE = "kvwarm_sweep"  # our blocks in Dynamo's artifact: at the top, per result, per skipped point
FPM_VERSION = 1
EXPLICIT = "explicit"  # Dynamo's stamp of a point from a points manifest: every point of ours
UNSTAMPED = "unstamped"  # Dynamo's regime of a decode point that carries no stamp


def points_over_ranks(sweep, kind: str):
    """The kind's points over every rank: those measured on every rank (in rank 0's order),
    each rank's measured rows by point, those skipped on some rank (with the first skipping
    rank's entry), and how many points the ranks recorded in all."""
    measured = [
        {
            point_key(r["point"]): r
            for r in a.get("results", [])
            if point_key(r["point"])[0] == kind and not is_continuation(r["point"])  # Dynamo has no such point
        }
        for a in sweep.ranks
    ]
    skipped: dict[tuple, dict] = {}
    for artifact in sweep.ranks:
        for entry in artifact.get("skipped_points", []):
            key = point_key(entry["point"])
            if key[0] == kind and not is_continuation(entry["point"]):
                skipped.setdefault(key, entry)
    everywhere = [key for key in measured[0] if all(key in m for m in measured[1:]) and key not in skipped]
    seen = set(skipped) | {key for m in measured for key in m}
    return everywhere, measured, skipped, len(seen)


def median(row: dict) -> float:
    median = row.get("median_seconds")
    return median if isinstance(median, (int, float)) else statistics.median_high(row["steady_seconds"])


def _variance(values: list[int]) -> float:
    return float(statistics.pvariance(values)) if len(values) > 1 else 0.0


def _fpm(point: dict, rank: int, benchmark_id: int, row: dict) -> dict:
    """One ForwardPassMetrics (Dynamo's msgspec struct, every count a JSON integer): the
    point's scheduled requests and the row's median as wall_time."""
    b, k = point["batch_size"], point["total_kv_read_tokens"]
    if point["point_type"] == v.PREFILL:
        n = point["total_prefill_tokens"]
        split = row.get("split") or {}  # as the shots ran (rows before it: N and P split evenly)
        new, prefixes = split.get("new_tokens") or balanced(n, b), split.get("prefix_tokens") or balanced(k, b)
        lengths = [a + c for a, c in zip(new, prefixes)]
        scheduled = {
            "num_prefill_requests": b,
            "sum_prefill_tokens": n,
            "var_prefill_length": _variance(lengths),
            "sum_prefill_kv_tokens": k,
            "num_decode_requests": 0,
            "sum_decode_kv_tokens": 0,
            "var_decode_kv_tokens": 0.0,
        }
    else:
        scheduled = {
            "num_prefill_requests": 0,
            "sum_prefill_tokens": 0,
            "var_prefill_length": 0.0,
            "sum_prefill_kv_tokens": 0,
            "num_decode_requests": b,
            "sum_decode_kv_tokens": k,
            "var_decode_kv_tokens": _variance(balanced(k, b)),
        }
    fpm = {
        "version": FPM_VERSION,
        "worker_id": "",
        "dp_rank": rank,
        "counter_id": benchmark_id,
        "wall_time": float(median(row)),
        "scheduled_requests": scheduled,
        "queued_requests": {
            "num_prefill_requests": 0,
            "sum_prefill_tokens": 0,
            "var_prefill_length": 0.0,
            "num_decode_requests": 0,
            "sum_decode_kv_tokens": 0,
            "var_decode_kv_tokens": 0.0,
        },
    }
    if point["point_type"] == v.DECODE:  # as Dynamo's warm-up marks its decode samples
        steps = len(row.get("steady_seconds") or [])
        if steps > 1:
            fpm["kvwarm_giant_median_of"] = steps
        fpm["kvwarm_steady_sample"] = True
    return fpm


def _row_extras(row: dict, size: int) -> dict:
    steps = list(row.get("steady_seconds") or [])
    return {
        "kv_seed_regime": row["kv_seed_regime"],
        "sample_reasons": list(row.get("sample_reasons") or []),
        "steady_seconds": steps,
        "median_seconds": median(row),
        "min_seconds": row.get("min_seconds", min(steps)),
        "max_seconds": row.get("max_seconds", max(steps)),
        "spread": row.get("spread", (max(steps) - min(steps)) / median(row) if median(row) else 0.0),
        "median_of": len(steps),
        "phases": row.get("phases"),
        "graph": row.get("graph"),
        "global_batch_size": row.get("global_batch_size", row["point"]["batch_size"] * size),
    }


def _skipped_regime(kind: str) -> str:
    """Dynamo's regime of a point that never ran: its skip entries carry no stamp."""
    return UNSTAMPED if kind == v.DECODE else v.NOT_APPLICABLE


def _row_graph(row: dict, kind: str, graphs) -> dict:
    """The graph a point's steps should run in: the row's own record where it has one, else
    what the engine's recorded graphs give (record.shape); all null where the record holds
    no graph modes."""
    graph = row.get("graph")
    if not (isinstance(graph, dict) and "expected_cudagraph_mode" in graph):
        if graphs is None:
            return {"mode": None, "capture": None, "padding": None, "reasons": []}
        graph = expected_graph(graphs, *step_tokens({"point_type": kind, **row["point"]}))
    return {
        "mode": graph.get("expected_cudagraph_mode"),
        "capture": graph.get("expected_capture_size"),
        # Dynamo writes null padding where nothing captures the step; the sweep's rows say 0.
        "padding": graph.get("padding_tokens") if graph.get("expected_capture_size") is not None else None,
        "reasons": list(graph.get("reasons") or []),
    }


def _point(key: tuple, benchmark_id: int, reasons: list[str], graph: dict) -> dict:
    kind, k, b, n = key
    return {
        "point_type": kind,
        "benchmark_id": benchmark_id,
        "total_prefill_tokens": n,
        "total_kv_read_tokens": k,
        "batch_size": b,
        "expected_cudagraph_mode": graph["mode"],
        "expected_capture_size": graph["capture"],
        "padding_tokens": graph["padding"],
        "sample_reasons": reasons,
        "partition": None,
        "rows": None,
    }


def _stamps(rows: list[dict]) -> list[str]:
    """Every rank's stamps, once each, in rank order: the point is the same on every rank."""
    out: list[str] = []
    for row in rows:
        out += [s for s in row.get("sample_reasons") or [] if s not in out]
    return out


@dataclass
class KindRows:
    """One kind's rows of a sweep, as Dynamo's artifact holds them."""

    everywhere: list[tuple]  # the points measured on every rank, in rank 0's order
    measured: list[dict]  # per rank: its measured rows by point
    expected: int  # points the ranks recorded in all (measured or skipped)
    points: dict[tuple, dict]  # Dynamo's point of each point measured everywhere
    fpms: dict[tuple, list[dict]]  # per point: each rank's ForwardPassMetrics
    groups: list[dict]  # Dynamo's iteration groups
    skipped: list[dict]  # Dynamo's skipped points
    missing: list[str]  # the kinds the sweep has no point of (Dynamo's missing phases)

    def results(self, rank: int, size: int) -> list[dict]:
        """The rank's `results`: Dynamo's point, its FPM, and ours (NAMESPACE) per point."""
        return [
            {
                "point": self.points[key],
                "kv_seed_regime": self.measured[rank][key]["kv_seed_regime"],
                "fpms": [self.fpms[key][rank]],
                NAMESPACE: _row_extras(self.measured[rank][key], size),
            }
            for key in self.everywhere
        ]


def kind_rows(sweep, kind: str, graphs, first: int = 1, first_skipped: int | None = None) -> KindRows:
    """The sweep's rows of one kind; `graphs`: rank 0's recorded CUDA graphs (for rows that
    carry no graph record of their own); `first`, `first_skipped`: the benchmark id of the
    first measured and of the first skipped point (default: right after the measured)."""
    everywhere, measured, skipped, expected = points_over_ranks(sweep, kind)
    points = {}
    for i, key in enumerate(everywhere, start=first):
        rows = [m[key] for m in measured]
        graph = _row_graph(rows[0], kind, graphs)
        points[key] = _point(key, i, [EXPLICIT, *graph["reasons"], *_stamps(rows)], graph)
    skipped_points = []
    first_skipped = first + len(everywhere) if first_skipped is None else first_skipped
    for i, (key, entry) in enumerate(skipped.items(), start=first_skipped):
        graph = _row_graph(entry, kind, graphs)
        skipped_points.append(
            {
                "point": _point(key, i, [EXPLICIT, *graph["reasons"]], graph),
                "kv_seed_regime": _skipped_regime(kind),
                "reason": entry["kv_seed_regime"].removeprefix(v.SKIP_PREFIX),
                NAMESPACE: {"kv_seed_regime": entry["kv_seed_regime"], "reason": entry.get("reason", "")},
            }
        )
    fpms = {
        key: [_fpm(points[key], r, points[key]["benchmark_id"], m[key]) for r, m in enumerate(measured)]
        for key in everywhere
    }
    groups = [
        {
            "benchmark_id": points[key]["benchmark_id"],
            "point": points[key],
            "expected_dp_ranks": list(range(sweep.size)),
            "complete": True,
            "wall_time": max(f["wall_time"] for f in fpms[key]),
            "rank_results": [{"dp_rank": r, "fpms": [fpms[key][r]]} for r in range(sweep.size)],
        }
        for key in everywhere
    ]
    return KindRows(everywhere, measured, expected, points, fpms, groups, skipped_points, [] if expected else [kind])


def agg_rows(sweep, graphs) -> KindRows:
    """Both kinds in one artifact, as Dynamo's agg mode: the prefill points measured on every
    rank, then the decode points, numbered 1..N in that order; the skipped points after them."""
    measured = {kind: len(points_over_ranks(sweep, kind)[0]) for kind in (v.PREFILL, v.DECODE)}
    skipped_prefill = len(points_over_ranks(sweep, v.PREFILL)[2])
    after = measured[v.PREFILL] + measured[v.DECODE] + 1
    prefill = kind_rows(sweep, v.PREFILL, graphs, 1, after)
    decode = kind_rows(sweep, v.DECODE, graphs, measured[v.PREFILL] + 1, after + skipped_prefill)
    return KindRows(
        prefill.everywhere + decode.everywhere,
        [{**p, **d} for p, d in zip(prefill.measured, decode.measured)],
        prefill.expected + decode.expected,
        prefill.points | decode.points,
        prefill.fpms | decode.fpms,
        prefill.groups + decode.groups,
        prefill.skipped + decode.skipped,
        prefill.missing + decode.missing,
    )
