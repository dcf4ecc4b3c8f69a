"""The sweep's artifact: sweep.json (validated against artifact.schema.json, schema version
2), sweep.csv, and at the end sweep.png where matplotlib imports. Written after every point, each
file through a unique temporary file and an atomic replace, so a failure mid-sweep never
loses the rows already measured and concurrent writers never collide.

Under data parallel each rank writes its own folder (OUT/dp<R>/) and then the combined
view OUT/sweep.json: every rank's status and row count, and per point each rank's median
and the maximum across ranks. It says "complete" only when every rank completed, and
"failed" (naming the rank and its error) once every rank is done and one did not. The
combined view is rebuilt under a file lock after each write of any rank, so the last
rank to write always sees every rank's latest record.
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from vllm.logger import init_logger

SCHEMA_VERSION = 2
SCHEMA_PATH = Path(__file__).with_name("artifact.schema.json")
ARTIFACT = "sweep.json"
logger = init_logger(__name__)


def _row(r, dp_size: int) -> dict:
    times = r.steady_seconds
    return {"point": {"total_kv_read_tokens": r.total_kv_read_tokens, "batch_size": r.batch_size},
            "global_batch_size": r.batch_size * dp_size, "kv_seed_regime": r.kv_seed_regime,
            "sample_reasons": r.sample_reasons, "steady_seconds": times, "median_seconds": r.median_seconds,
            "min_seconds": min(times), "max_seconds": max(times), "spread": r.spread or 0.0}


def build_artifact(rows, meta: dict, config: dict, status: str, error: str | None = None, *,
                   run: dict | None = None, layout=None) -> dict:
    """One rank's artifact. `run` holds what record.run_record read and the times."""
    run = run or {}
    layout = layout.as_dict() if layout is not None else {
        "data_parallel_size": 1, "data_parallel_rank": 0, "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1, "expert_parallel": False}
    measured = [r for r in rows if not r.kv_seed_regime.startswith("skip:")]
    skipped = [r for r in rows if r.kv_seed_regime.startswith("skip:")]
    engine_args = run.get("engine_args")
    return {
        "schema_version": SCHEMA_VERSION, "artifact_type": "rank", "status": status, "error": error,
        "started_at": run.get("started_at", ""), "finished_at": run.get("finished_at"),
        "config": {**config, **({"engine_args": engine_args} if engine_args else {})},
        "build": run.get("build"), "layout": layout, "hardware": run.get("hardware"), "torch": run.get("torch"),
        "kvwarm": {**meta, "points_real_kv": sum(r.kv_seed_regime == "real_kv" for r in measured),
                   "points_fake_fallback": sum(r.kv_seed_regime == "fake_fallback" for r in measured)},
        "results": [_row(r, layout["data_parallel_size"]) for r in measured],
        "skipped_points": [{"point": {"total_kv_read_tokens": r.total_kv_read_tokens, "batch_size": r.batch_size},
                            "kv_seed_regime": r.kv_seed_regime, "reason": r.detail or ""} for r in skipped],
    }


def validate(artifact: dict) -> None:
    import jsonschema

    jsonschema.validate(artifact, json.loads(SCHEMA_PATH.read_text()))


def write_atomically(path: Path, data: bytes) -> None:
    """A unique temporary file in the target folder, then an atomic replace: concurrent
    writers (other ranks, a reader) never see a partial file or collide on a name."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _csv(results: list[dict]) -> bytes:
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["total_kv_read_tokens", "batch_size", "global_batch_size", "kv_seed_regime", "median_ms",
                     "min_ms", "max_ms", "spread", "steady_ms", "sample_reasons"])
    for row in results:
        writer.writerow([row["point"]["total_kv_read_tokens"], row["point"]["batch_size"], row["global_batch_size"],
                         row["kv_seed_regime"], f"{row['median_seconds'] * 1e3:.4f}",
                         f"{row['min_seconds'] * 1e3:.4f}", f"{row['max_seconds'] * 1e3:.4f}",
                         f"{row['spread']:.4f}", " ".join(f"{t * 1e3:.4f}" for t in row["steady_seconds"]),
                         " ".join(row["sample_reasons"])])
    return text.getvalue().encode()


_said_no_plot = False


def _png(artifact: dict) -> bytes | None:
    """The plot of `python -m vllm.kvwarm report`, where matplotlib imports (it is not a
    vLLM requirement); said once per process when it does not."""
    global _said_no_plot
    try:
        from .report import plot_png
    except ImportError:
        plot_png = None
    png = plot_png(artifact) if plot_png is not None else None
    if png is None and not _said_no_plot:
        _said_no_plot = True
        logger.info("[kvwarm sweep] no sweep.png: matplotlib is not installed here (pip install matplotlib, "
                    "or render later with python -m vllm.kvwarm report OUT)")
    return png


def write_artifact(out_dir: str | Path, artifact: dict) -> list[Path]:
    validate(artifact)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / ARTIFACT, json.dumps(artifact, indent=2).encode())
    write_atomically(out / "sweep.csv", _csv(artifact["results"]))
    paths = [out / ARTIFACT, out / "sweep.csv"]
    if artifact["status"] == "running":
        # Drawn once, at the end: a plot costs about half a second, which would stall the
        # engine after every point; and no plot of an earlier run stays beside this record.
        (out / "sweep.png").unlink(missing_ok=True)
        return paths
    png = _png(artifact)
    if png is not None:
        write_atomically(out / "sweep.png", png)
        paths.append(out / "sweep.png")
    return paths


@contextmanager
def _locked(folder: Path):
    with open(folder / ".kvwarm-combine.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read_rank(folder: Path, rank: int) -> dict | None:
    try:
        return json.loads((folder / f"dp{rank}" / ARTIFACT).read_text())
    except (OSError, ValueError):
        return None


def combine(ranks: list[dict | None]) -> dict:
    """The combined view of every rank's artifact (None: that rank has written nothing yet)."""
    summary = []
    for rank, artifact in enumerate(ranks):
        status = artifact["status"] if artifact else "running"
        summary.append({"rank": rank, "status": status, "rows": len(artifact["results"]) if artifact else 0,
                        "error": artifact["error"] if artifact else None, "path": f"dp{rank}/{ARTIFACT}"})
    statuses = {s["status"] for s in summary}
    status = "running" if "running" in statuses else "complete" if statuses == {"complete"} else "failed"
    failed = [s for s in summary if s["status"] == "failed"]
    error = "; ".join(f"rank {s['rank']}: {s['error']}" for s in failed) or None
    first = next((a for a in ranks if a), None) or {}
    by_point: dict[tuple, list] = {}
    for rank, artifact in enumerate(ranks):
        for row in (artifact or {}).get("results", []):
            key = (row["point"]["total_kv_read_tokens"], row["point"]["batch_size"])
            by_point.setdefault(key, []).append((rank, row))
    results = []
    for key, entries in by_point.items():
        base = dict(min(entries, key=lambda e: e[0])[1])  # rank 0's row where it has one
        medians = [row["median_seconds"] for _, row in entries]
        base.update(median_seconds=max(medians), min_seconds=min(row["min_seconds"] for _, row in entries),
                    max_seconds=max(row["max_seconds"] for _, row in entries),
                    ranks=[{"rank": rank, "median_seconds": row["median_seconds"]} for rank, row in entries])
        base["spread"] = (base["max_seconds"] - base["min_seconds"]) / base["median_seconds"]
        results.append(base)
    skipped = [{**s, "rank": rank} for rank, a in enumerate(ranks) for s in (a or {}).get("skipped_points", [])]
    return {
        "schema_version": SCHEMA_VERSION, "artifact_type": "combined", "status": status, "error": error,
        "ranks": summary, "started_at": first.get("started_at", ""),
        "finished_at": max((a["finished_at"] for a in ranks if a and a["finished_at"]), default=None)
        if status != "running" else None,
        "config": first.get("config", {}), "build": first.get("build"), "torch": first.get("torch"),
        "hardware": first.get("hardware"),
        "layout": {**first.get("layout", {"data_parallel_size": len(ranks), "tensor_parallel_size": 1,
                                          "pipeline_parallel_size": 1, "expert_parallel": False}),
                   "data_parallel_rank": None},
        "kvwarm": first.get("kvwarm", {}), "results": results, "skipped_points": skipped,
    }


def write_combined(root: str | Path, size: int) -> dict:
    """Rebuild OUT/sweep.json from every rank's latest artifact (under a lock, so the last
    writer has read every rank's last write)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root):
        combined = combine([_read_rank(root, r) for r in range(size)])
        write_atomically(root / ARTIFACT, json.dumps(combined, indent=2).encode())
        write_atomically(root / "sweep.csv", _csv(combined["results"]))
        if combined["status"] != "running":
            from .ranks import SYNC_DIR

            shutil.rmtree(root / SYNC_DIR, ignore_errors=True)
    return combined
