"""The combined view of a data-parallel sweep: OUT/sweep.json over every rank's artifact.

Every rank's status and row count, and per point each rank's median and the maximum across
ranks. It says "complete" only when every rank completed, and "failed" (naming the rank and
its error) once every rank is done and one did not; a rank given up on (`lost`: it stopped
reporting) counts as failed with the reason. Built from every rank's artifact however they
were gathered: `write_view` from artifacts in hand (rank 0, through the ranks' store),
`write_combined` from every rank's OUT/dp<R>/ under a file lock (the file exchange), so the
last rank to write always sees every rank's latest record.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import vocabulary as v
from .artifact import all_results, results_csv
from .files import locked, write_atomically
from .shape import point_key

LOCK = ".kvwarm-combine.lock"


def rank_path(rank: int) -> str:
    return f"dp{rank}/{v.ARTIFACT}"


def _read_rank(folder: Path, rank: int) -> dict | None:
    try:
        return json.loads((folder / rank_path(rank)).read_text())
    except (OSError, ValueError):
        return None


def given_up(ranks: list[dict | None], lost: dict[int, str]) -> list[dict | None]:
    """Every rank's record, where one still says running but was given up on (`lost`: the
    rank and why) as failed with why: what Dynamo's files are written from, by the sweep's
    own hook (sweep.exchange.view) and by `export` (record.export.input) alike."""
    return [
        {**a, "status": v.FAILED, "error": lost[r]} if a and r in lost and a.get("status") == v.RUNNING else a
        for r, a in enumerate(ranks)
    ]


def combine(ranks: list[dict | None], lost: dict[int, str] | None = None) -> dict:
    """The combined view of every rank's artifact (None: that rank has written nothing yet).
    `lost`: ranks given up on, with why; one whose own record is final keeps its own status."""
    summary = []
    for rank, artifact in enumerate(ranks):
        status = artifact["status"] if artifact else v.RUNNING
        error = artifact["error"] if artifact else None
        if lost and rank in lost and status == v.RUNNING:
            status, error = v.FAILED, lost[rank]
        summary.append(
            {
                "rank": rank,
                "status": status,
                "rows": len(artifact["results"]) if artifact else 0,
                "error": error,
                "path": rank_path(rank),
            }
        )
    statuses = {s["status"] for s in summary}
    status = v.RUNNING if v.RUNNING in statuses else v.COMPLETE if statuses == {v.COMPLETE} else v.FAILED
    failed = [s for s in summary if s["status"] == v.FAILED]
    error = "; ".join(f"rank {s['rank']}: {s['error']}" for s in failed) or None
    first = next((a for a in ranks if a), None) or {}
    results, skipped = _merged(ranks)
    fake = [(a or {}).get(v.AB_FAKE_SIDE) for a in ranks]  # an A/B sweep's fake side, merged alike
    ab = dict(zip(("results", "skipped_points"), _merged(fake))) if any(fake) else None
    finished = [a["finished_at"] for a in ranks if a and a["finished_at"]]
    return {
        "schema_version": v.SCHEMA_VERSION,
        "artifact_type": v.COMBINED,
        "status": status,
        "error": error,
        "ranks": summary,
        "started_at": first.get("started_at", ""),
        "finished_at": max(finished, default=None) if status != v.RUNNING else None,
        "config": first.get("config", {}),
        "build": first.get("build"),
        "torch": first.get("torch"),
        "hardware": first.get("hardware"),
        "layout": {
            **first.get(
                "layout",
                {
                    "data_parallel_size": len(ranks),
                    "tensor_parallel_size": 1,
                    "pipeline_parallel_size": 1,
                    "expert_parallel": False,
                },
            ),
            "data_parallel_rank": None,
        },
        "kvwarm": first.get("kvwarm", {}),
        "results": results,
        "skipped_points": skipped,
        **({v.AB_FAKE_SIDE: ab} if ab is not None else {}),
    }


def _merged(ranks: list[dict | None]) -> tuple[list[dict], list[dict]]:
    """Every rank's rows as one per point (each rank's median, the slowest as the point's)
    and every rank's skipped points."""
    by_point: dict[tuple, list] = {}
    for rank, artifact in enumerate(ranks):
        for row in (artifact or {}).get("results", []):
            key = point_key(row["point"])
            by_point.setdefault(key, []).append((rank, row))
    results = []
    for entries in by_point.values():
        base = dict(min(entries, key=lambda e: e[0])[1])  # rank 0's row where it has one
        medians = [row["median_seconds"] for _, row in entries]
        base.update(
            median_seconds=max(medians),
            min_seconds=min(row["min_seconds"] for _, row in entries),
            max_seconds=max(row["max_seconds"] for _, row in entries),
            ranks=[{"rank": rank, "median_seconds": row["median_seconds"]} for rank, row in entries],
        )
        base["spread"] = (base["max_seconds"] - base["min_seconds"]) / base["median_seconds"]
        results.append(base)
    skipped = [{**s, "rank": rank} for rank, a in enumerate(ranks) for s in (a or {}).get("skipped_points", [])]
    return results, skipped


def write_view(root: str | Path, ranks: list[dict | None], lost: dict[int, str] | None = None) -> dict:
    """OUT/sweep.json and sweep.csv: the combined view of `ranks` (see combine)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    combined = combine(ranks, lost)
    write_atomically(root / v.ARTIFACT, json.dumps(combined, indent=2).encode())
    write_atomically(root / v.ARTIFACT_CSV, results_csv(all_results(combined)))
    return combined


def write_combined(root: str | Path, size: int, before_final=None, wait: bool = True) -> dict | None:
    """Rebuild OUT/sweep.json from every rank's latest artifact in OUT/dp<R>/ (under a lock,
    so the last writer has read every rank's last write). `before_final`: called with every
    rank's artifact when the view is final, before it is written (so whoever waits for the
    final view finds what it made). `wait` False: where another rank holds the lock, nothing
    is written (None), at once."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with locked(root / LOCK, wait) as held:
        if not held:
            return None
        ranks = [_read_rank(root, r) for r in range(size)]
        if before_final is not None and combine(ranks)["status"] != v.RUNNING:
            before_final(ranks)
        return write_view(root, ranks)
