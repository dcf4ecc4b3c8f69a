"""One rank's measurement record: sweep.json and sweep.csv (the plot, sweep.png, is
record.plot's), each file written through an atomic replace. While the sweep runs they are
rewritten at a pace (sweep.writer), compact and unchecked; the final write is checked against
record.schema. What a kill cannot take is in rows.jsonl (record.row_log): every row is
appended there as it ends, so a sweep that fails keeps every row in its final sweep.json, and
one killed outright loses at most the point it was measuring (its sweep.json lags behind its
rows.jsonl, which a resume reads: sweep.resume).

Plain data: nothing here imports vLLM. The sweep builds PointRows and a KvwarmMeta, and
`build_artifact` turns them into the JSON document; tests build their fixtures through it.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from . import vocabulary as v
from .files import write_atomically
from .schema import validate
from .shape import is_continuation, point_key


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PointRow:
    """One point as measured (or skipped)."""

    total_kv_read_tokens: int  # what the steps measured (a clamped point's differs from the file's)
    batch_size: int
    kv_seed_regime: str  # a vocabulary regime, or skip:<reason>
    sample_reasons: list[str] = field(default_factory=list)
    # every timed sample, each of `sample_kind` (the artifact's key: steady_seconds)
    samples: list[float] = field(default_factory=list)
    median_seconds: float | None = None
    detail: str | None = None  # why a point was skipped, in words
    point_type: str = v.DECODE
    total_prefill_tokens: int = 0  # prefill: N, the new tokens the step computes (decode: 0)
    phases: dict[str, float | None] | None = None  # the median of each vocabulary PHASES over the samples
    graph: dict | None = None  # the CUDA graph the steps should run in (record.shape.expected_graph)
    # what the runner reported each timed sample's step ran in, [mode, padded tokens] (None
    # for a sample it said nothing of); None: it reported none, and `observed_why` says why
    observed_graphs: list | None = None
    observed_why: str | None = None
    # what one sample times (vocabulary SAMPLE_KINDS); None: the usual kind of the point type
    sample_kind: str | None = None
    # prefill: each request's prefix and new tokens as the shots ran them (None: decode)
    split: dict[str, list[int]] | None = None
    # mixed: the step's decode part {batch_size, total_kv_read_tokens} and prefill part
    # {batch_size, total_prefill_tokens, total_kv_read_tokens}; the totals above are the step's
    parts: dict[str, dict[str, int]] | None = None
    # prefill: its requests were running, their prefix computed by an earlier step of their own
    continuation: bool = False
    # an A/B sweep's row (--ab): the side it measured (vocabulary AB_SIDES), and whether that
    # side ran first at its point (the sides alternate); None on other sweeps
    ab: str | None = None
    ab_first: bool | None = None

    def __post_init__(self):
        if self.sample_kind is None:
            self.sample_kind = v.SAMPLE_KIND_OF[self.point_type]

    @property
    def point(self) -> dict:
        return {
            "point_type": self.point_type,
            "total_kv_read_tokens": self.total_kv_read_tokens,
            "batch_size": self.batch_size,
            "total_prefill_tokens": self.total_prefill_tokens,
            **(self.parts or {}),
            **({"continuation": True} if self.continuation else {}),
        }

    @property
    def skipped(self) -> bool:
        return v.is_skipped(self.kv_seed_regime)

    @property
    def spread(self) -> float | None:
        """(max - min) / median of the timed samples."""
        if not self.samples or not self.median_seconds:
            return None
        return (max(self.samples) - min(self.samples)) / self.median_seconds


@dataclass
class KvwarmMeta:
    """The artifact's `kvwarm` block: what the warm-up decided and did for the whole sweep."""

    enabled: bool = False  # warm-up on or force
    warm_eligible: bool = False  # the gate admitted the model
    skip_reason: str | None = None  # the gate's reason when it did not
    dataset: dict | None = None  # {path, sha256, collection_pool, conversations}
    stages: list[dict] = field(default_factory=list)  # one per rung built: batch, depth, build_seconds
    giant_kv_repeats: int = 1  # the steady steps timed per point
    settle_steps: int = 0  # untimed steps of each point's shape before its timed ones
    giant_kv_threshold: int | None = None
    state_mode_requested: str | None = None  # DYN_BENCH_KV_WARMUP_STATE as given
    state_mode: str | None = None  # what the sweep used on a hybrid layout
    reset_prefix_cache: bool | None = None  # the leak check at the end (None: not made)
    noisy_spread: float | None = None  # a row whose steps spread more than this is stamped noisy
    batch_semantics: str = "per_rank"
    global_batch_factor: int = 1  # B x this = the batch over every data-parallel rank
    gc: dict | None = None  # the collector's policy over the sweep (sweep.gc_hold)
    cudagraph: dict | None = None  # the engine's CUDA-graph mode and capture sizes (sweep.graphs)
    grid: dict | None = None  # a generated grid: its points file and axes (sweep.grid)
    engine_loop: dict | None = None  # the engine's loop and the adapter class that served it (sweep.provenance)
    exchange: dict | None = None  # how the data-parallel ranks met: exchange, address, port, port_origin
    # what the sweep's plan is made from, which a resume holds itself to (sweep.resume.plan_inputs)
    plan: dict | None = None
    # a resumed sweep: each boot, {boot, started_at, rows}; what its resume replaced (sweep.resume)
    boots: list[dict] | None = None
    resume: dict | None = None
    ab: dict | None = None  # an A/B sweep (--ab): how the sides were measured (sweep.ab)

    @classmethod
    def read(cls, block: dict | None) -> KvwarmMeta:
        """The block of any artifact version (fields it lacks keep their defaults)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: val for k, val in (block or {}).items() if k in names})

    def as_dict(self, measured: list[PointRow]) -> dict:
        return {
            **dataclasses.asdict(self),
            "points_real_kv": sum(r.kv_seed_regime == v.REAL_KV for r in measured),
            "points_fake_fallback": sum(r.kv_seed_regime == v.FAKE_FALLBACK for r in measured),
        }


SINGLE_RANK = {
    "data_parallel_size": 1,
    "data_parallel_rank": 0,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "expert_parallel": False,
}


def graph_block(r: PointRow) -> dict | None:
    """The row's `graph`: the graph its shape expects (`r.graph`) and the one its steps ran in,
    as the runner reported it: per sample (`observed`), the median sample's mode and padded
    size (`observed_cudagraph_mode`, `observed_size`), or null and `why`. None where the row
    has neither."""
    if r.graph is None and r.observed_graphs is None and r.observed_why is None:
        return None
    median = None
    if r.observed_graphs is not None and r.median_seconds in r.samples:
        median = r.observed_graphs[r.samples.index(r.median_seconds)]
    return {
        **(r.graph or {}),
        "observed_cudagraph_mode": median[0] if median else None,
        "observed_size": median[1] if median else None,
        "observed": r.observed_graphs,
        "why": None if r.observed_graphs is not None else r.observed_why,
    }


def _stamps(r: PointRow, graph: dict | None) -> list[str]:
    """The row's stamps, and GRAPH_MISMATCH where its median sample ran another graph than
    its shape expects (both known)."""
    expected = (graph or {}).get("expected_cudagraph_mode")
    observed = (graph or {}).get("observed_cudagraph_mode")
    differs = None not in (expected, observed) and expected != observed and v.GRAPH_MISMATCH not in r.sample_reasons
    return [*r.sample_reasons, v.GRAPH_MISMATCH] if differs else r.sample_reasons


def _result(r: PointRow, dp_size: int) -> dict:
    times = r.samples
    graph = graph_block(r)
    return {
        "point": r.point,
        "global_batch_size": r.batch_size * dp_size,
        "kv_seed_regime": r.kv_seed_regime,
        "sample_reasons": _stamps(r, graph),
        "steady_seconds": times,
        "sample_kind": r.sample_kind,
        "median_seconds": r.median_seconds,
        "min_seconds": min(times),
        "max_seconds": max(times),
        "spread": r.spread or 0.0,
        "phases": r.phases,
        "graph": graph,
        **({"split": r.split} if r.split is not None else {}),
        **_ab(r),
    }


def _ab(r: PointRow) -> dict:
    return {"ab": r.ab, "ab_first": r.ab_first} if r.ab is not None else {}


def build_artifact(
    rows: list[PointRow],
    meta: KvwarmMeta,
    config: dict,
    status: str,
    error: str | None = None,
    *,
    run: dict | None = None,
    layout: dict | None = None,
) -> dict:
    """One rank's artifact. `run` holds the run record (build, torch, hardware, engine
    arguments) and the times; `layout` the rank layout (default: one rank). An A/B sweep's
    fake side goes to its own block (vocabulary AB_FAKE_SIDE): `results` and
    `skipped_points` are the real side's, the table every reader takes."""
    head = artifact_head(rows, meta, config, status, error, run=run, layout=layout)
    size, artifact = head["layout"]["data_parallel_size"], dict(head)
    for name, side in split(rows, head):
        lists = {
            "results": [entry(r, size) for r in side if not r.skipped],
            "skipped_points": [entry(r, size) for r in side if r.skipped],
        }
        artifact.update(lists) if name is None else artifact.update({name: lists})
    return artifact


def artifact_head(
    rows: list[PointRow],
    meta: KvwarmMeta,
    config: dict,
    status: str,
    error: str | None = None,
    *,
    run: dict | None = None,
    layout: dict | None = None,
) -> dict:
    """The artifact less its rows (build_artifact's arguments): what `split` lays them out by."""
    run = run or {}
    engine_args = run.get("engine_args")
    table = [r for r in rows if r.ab != v.AB_FAKE]
    return {
        "schema_version": v.SCHEMA_VERSION,
        "artifact_type": v.RANK,
        "status": status,
        "error": error,
        "started_at": run.get("started_at", ""),
        "finished_at": run.get("finished_at"),
        "config": {**config, **({"engine_args": engine_args} if engine_args else {})},
        "build": run.get("build"),
        "layout": layout or SINGLE_RANK,
        "hardware": run.get("hardware"),
        "torch": run.get("torch"),
        "kvwarm": meta.as_dict([r for r in table if not r.skipped]),
    }


def split(rows: list[PointRow], head: dict) -> list[tuple[str | None, list[PointRow]]]:
    """The rows by where they go: the table's (None) and, in an A/B sweep, the fake side's block."""
    table = [r for r in rows if r.ab != v.AB_FAKE]
    if head["kvwarm"].get("ab") is None and len(table) == len(rows):
        return [(None, table)]
    return [(None, table), (v.AB_FAKE_SIDE, [r for r in rows if r.ab == v.AB_FAKE])]


def entry(r: PointRow, size: int) -> dict:
    """A row as its artifact entry: a measured row's in `results`, a skipped one's in
    `skipped_points`; `size`: the data-parallel size."""
    if r.skipped:
        return {"point": r.point, "kv_seed_regime": r.kv_seed_regime, "reason": r.detail or "", **_ab(r)}
    return _result(r, size)


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value * 1e3:.4f}"


def results_csv(results: list[dict]) -> bytes:
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(
        [
            "point_type",
            "total_kv_read_tokens",
            "batch_size",
            "total_prefill_tokens",
            "global_batch_size",
            "kv_seed_regime",
            "median_ms",
            "min_ms",
            "max_ms",
            "spread",
            "steady_ms",
            *(f"{phase}_ms" for phase in v.PHASES),
            "expected_capture_size",
            "padding_tokens",
            "sample_reasons",
            "decode_batch_size",  # mixed rows: the decode part (the prefill part is the rest)
            "decode_kv_read_tokens",
            "continuation",  # 1: the prefill requests were running ones (sweep-reference.md#continuation-points)
            "ab",  # an A/B sweep's rows: the side (real, fake); empty on other sweeps
            "observed_cudagraph_mode",  # the graph the median sample ran in, where the runner said
            "observed_size",
        ]
    )
    for row in results:
        kind, k, b, n = point_key(row["point"])[:4]
        decode = row["point"].get("decode") or {}
        phases, graph = row.get("phases") or {}, row.get("graph") or {}
        writer.writerow(
            [
                kind,
                k,
                b,
                n,
                row["global_batch_size"],
                row["kv_seed_regime"],
                _ms(row["median_seconds"]),
                _ms(row["min_seconds"]),
                _ms(row["max_seconds"]),
                f"{row['spread']:.4f}",
                " ".join(_ms(t) for t in row["steady_seconds"]),
                *(_ms(phases.get(p)) for p in v.PHASES),
                graph.get("expected_capture_size", ""),
                graph.get("padding_tokens", ""),
                " ".join(row["sample_reasons"]),
                decode.get("batch_size", ""),
                decode.get("total_kv_read_tokens", ""),
                1 if is_continuation(row["point"]) else "",
                row.get("ab") or "",
                graph.get("observed_cudagraph_mode") or "",
                "" if graph.get("observed_size") is None else graph["observed_size"],
            ]
        )
    return text.getvalue().encode()


def all_results(artifact: dict) -> list[dict]:
    """Every measured row: the results, then an A/B sweep's fake side's."""
    return [*artifact["results"], *(artifact.get(v.AB_FAKE_SIDE) or {}).get("results", [])]


def row_lists(artifact: dict) -> tuple[list, list, list, list]:
    """An artifact's results and skipped points, then an A/B sweep's fake side's (empty where
    it has none): what a rank hands on as they grow."""
    fake = artifact.get(v.AB_FAKE_SIDE) or {}
    return artifact["results"], artifact["skipped_points"], fake.get("results", []), fake.get("skipped_points", [])


def without_rows(artifact: dict) -> dict:
    """An artifact less its rows (both sides')."""
    return {k: x for k, x in artifact.items() if k not in ("results", "skipped_points", v.AB_FAKE_SIDE)}


def write_artifact(out_dir: str | Path, artifact: dict) -> list[Path]:
    """sweep.json and sweep.csv of a final artifact, checked against the schema first (a
    running one is sweep.writer's: compact, unchecked, without its CSV)."""
    validate(artifact)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / v.ARTIFACT, json.dumps(artifact, indent=2).encode())
    write_atomically(out / v.ARTIFACT_CSV, results_csv(all_results(artifact)))
    return [out / v.ARTIFACT, out / v.ARTIFACT_CSV]
