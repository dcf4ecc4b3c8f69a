"""One table from several sweeps of the same grid: each row's timed samples pooled over the
sweeps and its median taken again.

Why: a row's samples are a few steps in a row, about 50 ms, so its median is the host's speed
at that moment. On the development host that speed moves 20-40 % within seconds (the floor,
floor.py, read 0.77 and 1.11 ms three seconds apart), so single rows of one table were off by
+36 % and -45 % against the same served steps (docs/measurements/mixed-steps.md). Sweeps of one grid a
minute or two apart catch each row at other moments; the median of the pooled samples stands
on all of them, as the served steps do. The spread of a row's medians across the sweeps is
what one sweep's row is worth on this host: printed, and in the JSON line.

A row is the results of one point over the sweeps (shape.point_key, as the data-parallel view
keys ranks' rows; the grid comes from one trace, so the sweeps lay the same points); a point
one sweep skipped pools the others'.
The phases (validate's forward basis) are the median of the sweeps' phase medians.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from vllm.kvwarm.record import vocabulary as v
from vllm.kvwarm.record.artifact import results_csv
from vllm.kvwarm.record.shape import point_key

from .floor import spread


def _phases(rows: list[dict]) -> dict | None:
    seen = [r["phases"] for r in rows if r.get("phases")]
    if not seen:
        return None
    names = {name for phases in seen for name in phases}
    pooled = {}
    for name in sorted(names):
        values = [p[name] for p in seen if p.get(name) is not None]
        pooled[name] = statistics.median(values) if values else None
    return pooled


def _pooled_row(rows: list[dict]) -> dict:
    samples = [s for r in rows for s in r["steady_seconds"]]
    median = statistics.median(samples)
    return {
        **rows[0],
        "steady_seconds": samples,
        "median_seconds": median,
        "min_seconds": min(samples),
        "max_seconds": max(samples),
        "spread": (max(samples) - min(samples)) / median if median else 0.0,
        "phases": _phases(rows),
        "sample_reasons": sorted({reason for r in rows for reason in r.get("sample_reasons") or []}),
    }


def pool(artifacts: list[dict], out: Path) -> tuple[dict, dict]:
    """The first sweep's artifact with its rows pooled over `artifacts` (complete sweeps of
    one grid), written as out/sweep.json and sweep.csv; returns it and what the pooling saw:
    sweeps, rows, rows every sweep measured, the median and largest spread of a row's medians."""
    if not artifacts:
        raise ValueError("pool needs at least one sweep's artifact")
    by_key: dict[tuple, list[dict]] = {}
    for artifact in artifacts:
        for result in artifact["results"]:
            by_key.setdefault(point_key(result["point"]), []).append(result)
    results = [_pooled_row(rows) for rows in by_key.values()]
    measured = [r["point"] for r in results]
    skipped = [s for s in artifacts[0].get("skipped_points", []) if s["point"] not in measured]
    # how far apart one row's medians are across the sweeps
    spreads = [s for s in (spread([r["median_seconds"] for r in rows]) for rows in by_key.values()) if s is not None]
    document = {**artifacts[0], "results": results, "skipped_points": skipped}
    out.mkdir(parents=True, exist_ok=True)
    (out / v.ARTIFACT).write_text(json.dumps(document, indent=1))
    (out / v.ARTIFACT_CSV).write_bytes(results_csv(results))
    seen = {
        "sweeps": len(artifacts),
        "rows": len(results),
        "rows_in_every_sweep": sum(len(rows) == len(artifacts) for rows in by_key.values()),
        "row_medians_spread_pct": round(statistics.median(spreads), 2) if spreads else None,
        "row_medians_spread_max_pct": round(max(spreads), 2) if spreads else None,
    }
    return document, seen
