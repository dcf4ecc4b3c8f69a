"""`python -m vllm.kvwarm export DIR --to dynamo|profiler|fpm [--out PATH]`: a sweep's rows in
the files the planners read (docs/export.md). `--to dynamo`: the per-rank artifact of Dynamo's
self-benchmark, `--to profiler`: the pre-deployment profiler's two interpolation tables (both
record.export.write). `--to fpm`: DIR is a served-step trace, written as Dynamo's forward-pass
metrics capture (record.export.fpm).

Plain data: nothing here imports vLLM.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import vocabulary as v
from ..trace.reader import TraceError
from .dynamo import AGG
from .fpm import is_trace, write_fpm
from .input import ExportError, load_sweep, without_prefix
from .write import write_dynamo, write_profiler

DYNAMO, PROFILER, FPM = "dynamo", "profiler", "fpm"


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
    if sweep.ab:
        print(
            f"kvwarm export: {sweep.root} is an A/B sweep: its real-KV rows (its table) are exported, its fake side not"
        )
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
    for note in trace.notes:
        print(f"kvwarm export: trace: {note}", file=sys.stderr)
    note = f" ({left_out} step(s) without a wall or a span left out)" if left_out else ""
    print(f"wrote {path}: {len(trace.steps) - left_out} forward-pass metrics of {len(trace.headers)} rank(s){note}")
    return 0
