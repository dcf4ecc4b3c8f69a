"""Where a served decode step and a table's row of the same shape differ, phase by phase
(schedule, forward, update, sweep, other: the StepTimer's, the same on both sides): every
decode-only traced step with a window is matched to the table's row of the same batch and
the nearest context within MATCH_TOLERANCE, and each phase's served time is set against the
row's median of that phase. Printed as the median difference in ms and the median ratio, per
phase and for the whole window; the sum of the phases' differences is the gap.
"""

from __future__ import annotations

import statistics

from kvwarm_testing.served import trace_lines

PHASES = ("schedule", "forward", "update", "sweep", "other")
MATCH_TOLERANCE = 0.1  # |K - row K| / K


def decode_rows(artifact: dict) -> dict[int, list[tuple[int, dict, float]]]:
    """Per batch size: (K, phase medians, whole-step median) of every measured decode row."""
    rows: dict[int, list] = {}
    for row in artifact.get("results", []):
        point = row["point"]
        if point.get("point_type", "decode") == "decode" and row.get("phases") and row.get("median_seconds"):
            rows.setdefault(point["batch_size"], []).append(
                (point["total_kv_read_tokens"], row["phases"], row["median_seconds"])
            )
    return rows


def matched(trace, artifact: dict) -> list[tuple[object, tuple]]:  # (record.trace.steps.Step, row)
    rows, pairs = decode_rows(artifact), []
    for step in trace_lines(trace)[1]:
        b, k = step.decode_requests, step.decode_kv_tokens
        if step.wall is None or step.prefill_requests or not b or b not in rows:
            continue
        row = min(rows[b], key=lambda r: abs(r[0] - k))
        if abs(row[0] - k) <= MATCH_TOLERANCE * max(k, 1):
            pairs.append((step, row))
    return pairs


def compare(trace, artifact: dict) -> dict | None:
    """Per phase (and "wall"): the median served − row difference (ms) and served / row ratio."""
    pairs = matched(trace, artifact)
    if not pairs:
        return None
    result = {"steps": len(pairs)}
    for phase in (*PHASES, "wall"):
        diffs, ratios = [], []
        for step, (_, phases, median) in pairs:
            served = step.wall if phase == "wall" else step.phases.get(phase, 0.0)
            row = median if phase == "wall" else phases.get(phase) or 0.0
            diffs.append((served - row) * 1e3)
            if row > 0:
                ratios.append(served / row)
        result[phase] = {
            "diff_ms": round(statistics.median(diffs), 4),
            "ratio": round(statistics.median(ratios), 4) if ratios else None,
        }
    return result


def print_comparison(label: str, result: dict | None) -> None:
    if result is None:
        print(f"  {label}: no decode step matched a row (same B, K within {MATCH_TOLERANCE:.0%})", flush=True)
        return
    cells = "  ".join(
        f"{p} {result[p]['diff_ms']:+.3f} ms" + (f" (x{result[p]['ratio']:.3f})" if result[p]["ratio"] else "")
        for p in (*PHASES, "wall")
    )
    print(f"  {label}, {result['steps']} matched decode steps, served − table: {cells}", flush=True)
