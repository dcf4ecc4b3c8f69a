"""Writing a finished sweep as the planners' files: Dynamo's self-benchmark artifact (one file
per data-parallel rank and kind; record.export.dynamo) and the pre-deployment profiler's two
interpolation tables (record.export.profiler).

Also the sweep's own hook: with DYN_FPM_BENCHMARK_OUTPUT_PATH set, the rank that holds every
rank's final artifact writes Dynamo's artifact there (`write_final`), so a campaign configured
for Dynamo's worker reads this image's output unchanged. A sweep with both kinds writes both
in the file at that path (Dynamo's agg mode, which its worker and its planner read) and each
kind on its own beside it (AIConfigurator's collector takes one kind per cell).

Plain data: nothing here imports vLLM (numpy only for the profiler's npz files).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import vocabulary as v
from ..combined import rank_path
from ..files import write_atomically
from .dynamo import AGG, rank_artifacts
from .input import ExportError, SweepRecord
from .profiler import write_tables

OUTPUT_ENV = "DYN_FPM_BENCHMARK_OUTPUT_PATH"  # Dynamo's own variable for its artifact's path


def dynamo_paths(out: str | Path, kinds: list[str], size: int) -> dict[tuple[str, int], Path]:
    """Where each (kind, rank) file goes: Dynamo's own naming, `<stem>_dp<R><ext>` for rank
    R > 0; with both kinds, both (AGG) at `out` and each kind on its own with `_<kind>` after
    the stem (the collector takes one kind per cell)."""
    base, ext = os.path.splitext(str(out))
    stems = {kinds[0]: base} if len(kinds) == 1 else {AGG: base, **{kind: f"{base}_{kind}" for kind in kinds}}
    return {
        (kind, rank): Path(f"{stem}_dp{rank}{ext}" if rank else f"{stem}{ext}")
        for kind, stem in stems.items()
        for rank in range(size)
    }


def write_dynamo(sweep: SweepRecord, out: str | Path, kind: str | None = None) -> list[Path]:
    if kind and kind not in sweep.kinds():
        raise ExportError(
            f"{sweep.root}: the sweep has no {kind} points (it has {', '.join(sweep.kinds())} points): export "
            f"without --kind, or with --kind {sweep.kinds()[0]}"
        )
    kinds = [kind] if kind else sweep.kinds()
    paths = dynamo_paths(out, kinds, sweep.size)
    written = []
    for k in dict.fromkeys(k for k, _ in paths):
        files = [paths[(k, r)] for r in range(sweep.size)]
        for path, artifact in zip(files, rank_artifacts(sweep, k, files)):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, json.dumps(artifact, indent=2).encode())
            written.append(path)
    return written


def write_profiler(sweep: SweepRecord, out: str | Path, max_kv_tokens: int | None = None) -> list[Path]:
    return write_tables(sweep, Path(out), max_kv_tokens)


def remove_stale(environ, rank: int) -> None:
    """At a sweep's start, as Dynamo does: this rank's files of an earlier run at
    DYN_FPM_BENCHMARK_OUTPUT_PATH go, so a campaign never reads them as this run's."""
    out = environ.get(OUTPUT_ENV)
    if not out:
        return
    for kinds in ([v.DECODE], list(v.POINT_TYPES)):
        for (_, r), path in dynamo_paths(out, kinds, rank + 1).items():
            if r == rank:
                path.unlink(missing_ok=True)


def write_final(root: str | Path, ranks: list[dict | None], environ) -> list[Path]:
    """The sweep's hook once every rank's record is final (`ranks`: each rank's artifact, as
    the rank that holds them all has them): with DYN_FPM_BENCHMARK_OUTPUT_PATH set, Dynamo's
    artifact at that path, every rank's file. ExportError where a rank's record is missing or
    still running: Dynamo's files hold every rank's steps (the store's view hands a rank it
    gave up on here as failed, with why: sweep.exchange.view)."""
    out = environ.get(OUTPUT_ENV)
    if not out:
        return []
    unfinished = [r for r, a in enumerate(ranks) if a is None or a.get("status") not in (v.COMPLETE, v.FAILED)]
    if unfinished:
        raise ExportError(
            f"rank(s) {unfinished} never finished their record (given up on): Dynamo's artifact holds every "
            "rank's steps, so none is written; each rank's own record is in its OUT/dp<R>/"
        )
    size = len(ranks)
    paths = [Path(root) / (rank_path(r) if size > 1 else v.ARTIFACT) for r in range(size)]
    return write_dynamo(SweepRecord(Path(root), list(ranks), paths), out)
