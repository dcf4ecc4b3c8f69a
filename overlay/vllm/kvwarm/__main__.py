"""`python -m vllm.kvwarm info [--json]`: what this build is and which hooks it has.
`python -m vllm.kvwarm sweep --points FILE --out DIR [engine args]`: a decode sweep.
`python -m vllm.kvwarm report DIR [DIR ...] [--out OUTDIR]`: sweeps rendered and compared.
`python -m vllm.kvwarm export DIR --to dynamo|profiler [--out PATH]`: a sweep in the files the
planners read (Dynamo's self-benchmark artifact, the pre-deployment profiler's tables).
`python -m vllm.kvwarm validate TABLE TRACE [--out DIR] [--json]`: a sweep's table held
against a served-step trace, per step kind and KV band."""

from __future__ import annotations

import argparse
import json
import sys

from vllm.kvwarm import build_record
from vllm.kvwarm.kv.capabilities import probe


def _info(as_json: bool) -> int:
    import vllm

    record = build_record()
    report = {"vllm_version": vllm.__version__, "build": record, "capabilities": probe()}
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    if record is None:
        print(f"vLLM {vllm.__version__}: not a kvwarm build (no build record)")
    else:
        print(f"vLLM {record['version']} ({record['flavour']} flavour of {record['release']})")
        print(f"  series digest   {record['series_digest']}")
        print(f"  overlay digest  {record['overlay_digest']}")
        print(f"  revision        {record['revision']}")
        print(f"  built from      {record['upstream_wheel']}")
    print("capabilities:")
    width = max(len(name) for name in report["capabilities"])
    for name, row in report["capabilities"].items():
        state = {True: "yes", False: "no", None: "unknown"}[row["present"]]
        note = f"  ({row['error']})" if "error" in row else ""
        print(f"  {name:<{width}}  {state:<7}  {row['where']}{note}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sweep"]:  # takes every vLLM engine argument: its own parser
        from vllm.kvwarm.sweep.command import run

        return run(argv[1:])
    if argv[:1] == ["report"]:  # its own parser too: the page, the CSV and the A/B comparison
        from vllm.kvwarm.record.report import run

        return run(argv[1:])
    if argv[:1] == ["export"]:  # its own parser: the planners' file formats
        from vllm.kvwarm.record.export.command import run

        return run(argv[1:])
    if argv[:1] == ["validate"]:  # its own parser: a table held against a served-step trace
        from vllm.kvwarm.record.validate.command import run

        return run(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m vllm.kvwarm")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="release, flavour, series digest and hooks of this build")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    commands.add_parser("sweep", help="decode sweep on the real engine (see sweep --help)")
    commands.add_parser("report", help="render and compare sweep artifacts (see report --help)")
    commands.add_parser("export", help="a sweep as Dynamo's or the profiler's files (see export --help)")
    commands.add_parser("validate", help="a table held against a served-step trace (see validate --help)")
    check = commands.add_parser("selfcheck", help="installed version, build record and series digest as expected")
    check.add_argument("--dist", default="vllm")
    check.add_argument("--expect-version", required=True)
    check.add_argument("--expect-series-digest", required=True)
    args = parser.parse_args(argv)
    if args.command == "selfcheck":
        from vllm.kvwarm.selfcheck import run

        return run(args.dist, args.expect_version, args.expect_series_digest)
    return _info(args.json)  # info: the only command left


if __name__ == "__main__":
    sys.exit(main())
