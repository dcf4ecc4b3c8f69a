"""The combined view of a data-parallel sweep: OUT/sweep.json over every rank's artifact.

Every rank's status and row count, and per point each rank's median and the maximum across
ranks, as compact JSON. It says "complete" only when every rank completed, and "failed"
(naming the rank and its error) once every rank is done and one did not; a rank given up on
(`lost`: it stopped reporting) counts as failed with the reason. Built from every rank's
artifact however they were gathered: `write_view` from artifacts in hand, `RunningView` from
rows as they arrive (rank 0, through the ranks' store: each rewrite encodes only what arrived
since the last), `write_combined` from every rank's OUT/dp<R>/ under a file lock (the file
exchange), so the last rank to write always sees every rank's latest record. An A/B sweep's
fake side (vocabulary AB_FAKE_SIDE) is combined alike, in a block of its own.
"""

from __future__ import annotations

import bisect
import itertools
import json
from pathlib import Path

from . import vocabulary as v
from .artifact import all_results, results_csv
from .files import locked, write_atomically
from .shape import point_key

LOCK = ".kvwarm-combine.lock"
COMPACT = (",", ":")  # JSON separators without spaces


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
    results, skipped = _merged(ranks)
    fake = [(a or {}).get(v.AB_FAKE_SIDE) for a in ranks]  # an A/B sweep's fake side, merged alike
    ab = dict(zip(("results", "skipped_points"), _merged(fake))) if any(fake) else None
    rows = [len(a["results"]) if a else 0 for a in ranks]
    return {
        **combined_head(ranks, rows, lost),
        "results": results,
        "skipped_points": skipped,
        **({v.AB_FAKE_SIDE: ab} if ab is not None else {}),
    }


def _merged(ranks: list[dict | None]) -> tuple[list[dict], list[dict]]:
    """Every rank's rows as one per point (combined_row) and every rank's skipped points."""
    by_point: dict[tuple, list] = {}
    for rank, artifact in enumerate(ranks):
        for row in (artifact or {}).get("results", []):
            by_point.setdefault(point_key(row["point"]), []).append((rank, row))
    skipped = [{**s, "rank": rank} for rank, a in enumerate(ranks) for s in (a or {}).get("skipped_points", [])]
    return [combined_row(entries) for entries in by_point.values()], skipped


def combined_row(entries: list[tuple[int, dict]]) -> dict:
    """A point's combined row from each rank's row of it ((rank, row), in rank order): rank
    0's row where it has one, the slowest rank's median, every rank's median."""
    base = dict(min(entries, key=lambda e: e[0])[1])
    medians = [row["median_seconds"] for _, row in entries]
    base.update(
        median_seconds=max(medians),
        min_seconds=min(row["min_seconds"] for _, row in entries),
        max_seconds=max(row["max_seconds"] for _, row in entries),
        ranks=[{"rank": rank, "median_seconds": row["median_seconds"]} for rank, row in entries],
    )
    base["spread"] = (base["max_seconds"] - base["min_seconds"]) / base["median_seconds"]
    return base


def combined_head(ranks: list[dict | None], rows: list[int], lost: dict[int, str] | None = None) -> dict:
    """The combined view less its rows, from every rank's artifact (its rows not read: `rows`
    gives each rank's count)."""
    summary = []
    for rank, artifact in enumerate(ranks):
        status = artifact["status"] if artifact else v.RUNNING
        error = artifact["error"] if artifact else None
        if lost and rank in lost and status == v.RUNNING:
            status, error = v.FAILED, lost[rank]
        summary.append({"rank": rank, "status": status, "rows": rows[rank], "error": error, "path": rank_path(rank)})
    statuses = {s["status"] for s in summary}
    status = v.RUNNING if v.RUNNING in statuses else v.COMPLETE if statuses == {v.COMPLETE} else v.FAILED
    failed = [s for s in summary if s["status"] == v.FAILED]
    error = "; ".join(f"rank {s['rank']}: {s['error']}" for s in failed) or None
    first = next((a for a in ranks if a), None) or {}
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
    }


def encode(value) -> str:
    """Compact JSON: a view is rewritten while a sweep runs, and indenting it triples the cost."""
    return json.dumps(value, separators=COMPACT)


def write_view(root: str | Path, ranks: list[dict | None], lost: dict[int, str] | None = None) -> dict:
    """OUT/sweep.json and sweep.csv: the combined view of `ranks` (see combine)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    combined = combine(ranks, lost)
    write_atomically(root / v.ARTIFACT, encode(combined).encode())
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


class _Side:
    """One side of a running view (the table, or an A/B sweep's fake side): each point's
    combined row encoded when one of its ranks' rows arrives, never again."""

    def __init__(self, size: int):
        self.rows: list[tuple[list, list]] = [([], []) for _ in range(size)]  # per rank: results, skipped
        self._entries: dict[tuple, list[tuple[int, dict]]] = {}  # point: (rank, row), in rank order
        self._first: dict[tuple, int] = {}  # point: the lowest rank holding it
        # per rank, the points it is the lowest rank to hold, in its order: combine's order
        self._sections: list[dict[tuple, None]] = [{} for _ in range(size)]
        self._json: dict[tuple, str] = {}  # point: its combined row, encoded
        self._csv: dict[tuple, bytes] = {}  # point: its line of sweep.csv
        self._skipped: list[list[str]] = [[] for _ in range(size)]  # per rank: its skipped points, encoded
        self._changed: set[tuple] = set()  # points whose combined row is not encoded yet

    def take(self, rank: int, results: list[dict], skipped: list[dict]) -> None:
        self.rows[rank][0].extend(results)
        self.rows[rank][1].extend(skipped)
        for row in results:
            key = point_key(row["point"])
            entries = self._entries.setdefault(key, [])
            entries.insert(bisect.bisect_right([r for r, _ in entries], rank), (rank, row))
            first = self._first.get(key)
            if first is None or rank < first:
                if first is not None:
                    del self._sections[first][key]
                self._sections[rank][key] = None
                self._first[key] = rank
            self._changed.add(key)
        self._skipped[rank] += [encode({**s, "rank": rank}) for s in skipped]

    @property
    def empty(self) -> bool:
        return not any(results or skipped for results, skipped in self.rows)

    def encoded(self) -> tuple[str, bytes]:
        """The side as the view's JSON object {"results", "skipped_points"} and its CSV lines."""
        for key in self._changed:
            row = combined_row(self._entries[key])
            self._json[key], self._csv[key] = encode(row), results_csv([row])[len(CSV_HEADER) :]
        self._changed.clear()
        order = list(itertools.chain.from_iterable(self._sections))
        text = "".join(
            (
                '"results":[',
                ",".join(map(self._json.__getitem__, order)),
                '],"skipped_points":[',
                ",".join(itertools.chain.from_iterable(self._skipped)),
                "]",
            )
        )
        return text, b"".join(map(self._csv.__getitem__, order))


class RunningView:
    """A combined view kept as every rank's rows arrive (rank 0's, through the ranks' store),
    written as combine would write it from the same artifacts. A rewrite of the view encodes
    what arrived since the last one and joins the rest (_Side), and no combined artifact is
    kept between writes."""

    def __init__(self, size: int):
        self.heads: list[dict | None] = [None] * size  # each rank's latest artifact less its rows
        self.table = _Side(size)
        self.fake = _Side(size)  # an A/B sweep's fake side (rows whose `ab` says fake)

    @property
    def rows(self) -> list[tuple[list, list]]:
        """Per rank: the table's results and skipped points so far."""
        return self.table.rows

    def take(self, rank: int, head: dict, results: list[dict], skipped: list[dict]) -> None:
        """Rank `rank`'s artifact less its rows (`head`) and the rows it added since, of either
        side (an A/B sweep's rows say theirs: `ab`)."""
        self.heads[rank] = head
        for side, fake in ((self.table, False), (self.fake, True)):
            side.take(
                rank,
                [r for r in results if (r.get("ab") == v.AB_FAKE) == fake],
                [s for s in skipped if (s.get("ab") == v.AB_FAKE) == fake],
            )

    @property
    def ab(self) -> bool:
        """Whether the view holds a fake side: an A/B sweep's (its record says so, as a rank's
        artifact then holds the block: record.artifact.split), or fake rows arrived."""
        return not self.fake.empty or any(h and (h.get("kvwarm") or {}).get("ab") for h in self.heads)

    def artifacts(self) -> list[dict | None]:
        """Every rank's artifact as it stands (its head and its rows)."""
        artifacts, ab = [], self.ab
        for rank, head in enumerate(self.heads):
            if head is None:
                artifacts.append(None)
                continue
            results, skipped = self.table.rows[rank]
            fake_results, fake_skipped = self.fake.rows[rank]
            side = {v.AB_FAKE_SIDE: {"results": fake_results, "skipped_points": fake_skipped}}
            artifacts.append({**head, "results": results, "skipped_points": skipped, **(side if ab else {})})
        return artifacts

    def write(self, root: str | Path, lost: dict[int, str] | None = None) -> str:
        """OUT/sweep.json and sweep.csv as write_view writes them; returns the view's status."""
        head = combined_head(self.heads, [len(results) for results, _ in self.table.rows], lost)
        text = encode(head)
        assert text.endswith("}")
        table, table_csv = self.table.encoded()
        parts = [text[:-1], ",", table]
        csv = CSV_HEADER + table_csv
        if self.ab:
            fake, fake_csv = self.fake.encoded()
            parts += [f',"{v.AB_FAKE_SIDE}":{{', fake, "}"]
            csv += fake_csv
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        write_atomically(root / v.ARTIFACT, "".join((*parts, "}")).encode())
        write_atomically(root / v.ARTIFACT_CSV, csv)
        return head["status"]


CSV_HEADER = results_csv([])
