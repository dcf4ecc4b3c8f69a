"""`python -m vllm.kvwarm export DIR --to dynamo|profiler|fpm [--out PATH]`: a sweep's rows in
the files the planners read. `--to dynamo`: the per-rank artifact of Dynamo's self-benchmark
(record.export_dynamo; docs/export.md); `--to profiler`: the pre-deployment profiler's two
interpolation tables (record.export_profiler). `--to fpm`: DIR is a served-step trace, written
as Dynamo's forward-pass metrics capture (record.export_fpm).

Also the sweep's own hook: with DYN_FPM_BENCHMARK_OUTPUT_PATH set, the rank that holds every
rank's final artifact writes Dynamo's artifact there (`write_final`), so a campaign configured
for Dynamo's worker reads this image's output unchanged. A sweep with both kinds writes both
in the file at that path (Dynamo's agg mode, which its worker and its planner read) and each
kind on its own beside it (AIConfigurator's collector takes one kind per cell).

Plain data: nothing here imports vLLM (numpy only for the profiler's npz files).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import vocabulary as v
from .combined import rank_path
from .export_dynamo import AGG, rank_artifacts
from .export_fpm import is_trace, write_fpm
from .export_input import ExportError, SweepRecord, load_sweep, without_prefix
from .export_profiler import write_tables
from .files import write_atomically
from .trace_reader import TraceError

OUTPUT_ENV = "DYN_FPM_BENCHMARK_OUTPUT_PATH"  # Dynamo's own variable for its artifact's path
DYNAMO, PROFILER, FPM = "dynamo", "profiler", "fpm"


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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vllm.kvwarm export",
        description="A finished sweep's rows as Dynamo's self-benchmark artifact (one file per data-parallel "
        "rank and kind) or as the pre-deployment profiler's interpolation tables. See docs/export.md.",
    )
    p.add_argument(
        "dir",
        help="the sweep's --out folder (under data parallel: the one holding dp0/, dp1/, ...); with --to fpm, "
        "a served-step trace folder (the kvwarm_trace setting's out)",
    )
    p.add_argument("--to", required=True, choices=[DYNAMO, PROFILER, FPM])
    p.add_argument(
        "--out",
        help="dynamo: the rank-0 file's path (default DIR/dynamo/benchmark.json; rank R adds _dp<R>; a sweep "
        "with both kinds has both there, as Dynamo's agg mode, and each kind on its own at _decode / _prefill); "
        "profiler: a folder (default DIR/profiler); fpm: the capture file (default DIR/fpm.jsonl)",
    )
    p.add_argument(
        "--kind",
        choices=[*v.POINT_TYPES, AGG],
        help=f"dynamo: export only this kind ({AGG}: both in one file), at --out exactly",
    )
    p.add_argument(
        "--no-prefix-rows",
        action="store_true",
        help="dynamo: leave out prefill points with a prefix (P > 0), for a planner whose prefill fit "
        "reads only sum_prefill_tokens (the profiler's tables hold B = 1, P = 0 rows only anyway)",
    )
    p.add_argument(
        "--max-kv-tokens",
        type=int,
        help="profiler: the KV pool in tokens, for a sweep whose artifact does not record it "
        "(config.engine_args.resolved.kv_cache_tokens)",
    )
    return p


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.to == FPM:
        return _run_fpm(args.dir, args.out)
    if is_trace(Path(args.dir)):
        print(
            f"kvwarm export: {args.dir} is a served-step trace, not a sweep: export it with --to fpm", file=sys.stderr
        )
        return 2
    try:
        sweep = load_sweep(args.dir)
        if args.no_prefix_rows:
            sweep = without_prefix(sweep)
        if args.to == DYNAMO:
            written = write_dynamo(sweep, args.out or sweep.root / DYNAMO / "benchmark.json", args.kind)
        else:
            written = write_profiler(sweep, args.out or sweep.root / PROFILER, args.max_kv_tokens)
    except (ExportError, OSError) as err:
        print(f"kvwarm export: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


def _run_fpm(folder: str, out: str | None) -> int:
    try:
        path, left_out, trace = write_fpm(folder, out)
    except (TraceError, OSError) as err:
        print(f"kvwarm export: {err}", file=sys.stderr)
        return 2
    for torn in trace.torn:
        print(f"kvwarm export: torn last line, skipped: {torn}", file=sys.stderr)
    note = f" ({left_out} step(s) without a wall or a span left out)" if left_out else ""
    print(f"wrote {path}: {len(trace.steps) - left_out} forward-pass metrics of {len(trace.headers)} rank(s){note}")
    return 0
