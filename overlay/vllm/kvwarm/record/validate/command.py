"""`python -m vllm.kvwarm validate TABLE TRACE`: the command line over validate()
(record.validate.validation) and its outputs (record.validate.output); docs/validate.md."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .output import text, write
from .predict import BASES, STEP
from .validation import ValidateError, validate


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vllm.kvwarm validate",
        description="Predict every step of a served-step trace from a sweep's table; per step kind and KV band: "
        "coverage, MAPE, P95, bias and the trace's own repeat noise.",
    )
    p.add_argument("table", metavar="TABLE", help="a sweep's --out folder (one rank, or the data-parallel view)")
    p.add_argument("trace", metavar="TRACE", help="a trace folder (the kvwarm_trace setting's out)")
    p.add_argument("--out", default="kvwarm-validate", help="folder for validate.json, .csv, .png")
    p.add_argument("--json", action="store_true", help="print only the one-line JSON summary")
    p.add_argument(
        "--basis", choices=BASES, default=STEP, help="step: the whole window (default); forward: the forward phase"
    )
    p.add_argument(
        "--allow-loop-mismatch", action="store_true", help="hold a trace and a table of different engine loops together"
    )
    p.add_argument(
        "--skip-seconds",
        type=float,
        default=0.0,
        metavar="S",
        help="leave out the steps that ended within the trace's first S seconds (a fresh server's warm-up)",
    )
    return p


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        result = validate(args.table, args.trace, args.basis, args.allow_loop_mismatch, args.skip_seconds)
    except ValidateError as err:
        print(f"kvwarm validate: {err}", file=sys.stderr)
        return 2
    written, note = write(result, Path(args.out))
    if args.json:
        print(json.dumps(result.summary(), sort_keys=True))
        for torn in result.torn:
            print(f"kvwarm validate: torn last line, skipped: {torn}", file=sys.stderr)
        for note in result.trace_notes:
            print(f"kvwarm validate: trace: {note}", file=sys.stderr)
    else:
        print(text(result))
        print(f"\nwrote {', '.join(p.name for p in written)} in {Path(args.out).resolve()}")
    if note:
        print(f"kvwarm validate: {note}", file=sys.stderr)
    return 0
