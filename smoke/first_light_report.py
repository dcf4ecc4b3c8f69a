"""Results of the first-light steps (smoke/first_light.py), what a run's log and artifact
say about the loop that ran, and the output folder: at most 8 files of at most 16 MiB
(summary.json, summary.txt, logs.tar.gz, artifacts.tar.gz, ...), the table printed last.

  record STEP STATUS DETAIL   a step's result where the step could not write its own
                              (killed at its timeout, skipped for time)
  summary                     WORK/results/*.json -> OUT/summary.json, OUT/summary.txt
  pack                        logs and artifacts -> OUT/logs.tar.gz, OUT/artifacts.tar.gz
Standard library only: it runs when nothing else does.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The steps in priority order (gpu_first_light.sh runs them so); the summary lists them so.
ORDER = ["install", "info", "models", "generate", "sweep", "shadows", "hybrid", "fidelity", "served"]
ORDER += ["nemotron-exact", "nemotron-inplace", "nemotron-copy", "mla", "served-moe"]
MIB = 1 << 20
LOG_TAIL = 3 * MIB  # what each log keeps (its end) in logs.tar.gz
MAX_FILE = 15 * MIB  # under the 16 MiB a file may have to come back
# What an engine's log says about how it ran (the first match of each).
LOG_FACTS = {
    "scheduler_cls": r"Using custom scheduler class (\S+?)\.? ",
    "async_scheduling": r"Asynchronous scheduling is (enabled|disabled)",
    "attention_backend": r"Using (\S+) attention backend",
    "moe_backend": r"Using (.+?) Unquantized MoE backend",
    "graph_capture": r"(Graph capturing finished in [^\n]*)",
    "compile": r"(torch\.compile takes [^\n]*)",
    "engine_init": r"(init engine \(profile, create kv cache, warmup model\) took [^\n]*)",
}


@dataclass
class Result:
    step: str
    status: str  # pass | fail | skip | timeout
    detail: str = ""
    seconds: float | None = None
    facts: dict = field(default_factory=dict)

    def write(self, work: Path) -> None:
        folder = work / "results"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{self.step}.json").write_text(json.dumps(asdict(self), indent=1, default=str) + "\n")


def _find(obj, keys: tuple[str, ...]):
    """The first value under any of `keys`, anywhere in a JSON document."""
    if isinstance(obj, dict):
        for key in keys:
            if key in obj:
                return obj[key]
        values = obj.values()
    elif isinstance(obj, list):
        values = obj
    else:
        return None
    for value in values:
        found = _find(value, keys)
        if found is not None:
            return found
    return None


def loop_facts(artifact: dict) -> dict:
    """What an artifact records about the scheduling loop: vLLM's resolved async setting,
    and a record of the loop the sweep ran in where the build writes one."""
    loop = _find(artifact, ("loop", "scheduler_loop", "engine_loop"))
    return {
        "async_scheduling_resolved": _find(artifact, ("async_scheduling",)),
        "loop_recorded": loop if loop is not None else "not recorded by this build",
        "cudagraph_mode": _find(artifact, ("cudagraph_mode",)),
        "capture_sizes": _find(artifact, ("cudagraph_capture_sizes",)),
    }


def engine_log_facts(log: Path) -> dict:
    text = log.read_text(errors="replace") if log.exists() else ""
    facts = {}
    for name, pattern in LOG_FACTS.items():
        found = re.search(pattern, text)
        facts[name] = found.group(1) if found else None
    return facts


def record(work: Path, step: str, status: str, detail: str, seconds: float | None) -> None:
    """A step's result unless the step wrote its own (a step killed at its timeout did not)."""
    if not (work / "results" / f"{step}.json").exists():
        Result(step, status, detail, seconds).write(work)


def summary(work: Path, out: Path, asked: list[str] | None = None) -> int:
    results = {}
    for path in sorted((work / "results").glob("*.json")):
        found = json.loads(path.read_text())
        results[found["step"]] = found
    ordered = [results[s] for s in ORDER if s in results] + [r for s, r in results.items() if s not in ORDER]
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(ordered, indent=1) + "\n")
    width = max((len(r["step"]) for r in ordered), default=4)
    lines = [f"{'step':<{width}}  {'status':<7}  {'seconds':>7}  detail"]
    for r in ordered:
        seconds = "" if r.get("seconds") is None else f"{r['seconds']:.0f}"
        lines.append(f"{r['step']:<{width}}  {r['status']:<7}  {seconds:>7}  {r['detail']}")
    missing = [s for s in (asked or ORDER) if s not in results]
    if missing:
        lines.append(f"not run: {', '.join(missing)}")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 1 if any(r["status"] in ("fail", "timeout") for r in ordered) else 0


def _add_tail(tar: tarfile.TarFile, path: Path, name: str, keep: int) -> None:
    data = path.read_bytes()
    if len(data) > keep:
        data = b"[... cut: the first %d bytes]\n" % (len(data) - keep) + data[-keep:]
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _tarball(out: Path, files: list[tuple[Path, str]], keep: int) -> Path:
    """files into out (gzip), each cut to its last `keep` bytes; halved until under MAX_FILE."""
    while True:
        with tarfile.open(out, "w:gz") as tar:
            for path, name in files:
                _add_tail(tar, path, name, keep)
        if out.stat().st_size <= MAX_FILE or keep < 64 * 1024:
            return out
        keep //= 2


def pack(work: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    logs = [(p, p.relative_to(work).as_posix()) for p in sorted((work / "logs").rglob("*")) if p.is_file()]
    _tarball(out / "logs.tar.gz", logs, LOG_TAIL)
    wanted = (
        "sweeps",
        "generate",
        "served",
        "served-moe",
        "results",
        "info.json",
        "nvidia-smi.txt",
        "kit-manifest.json",
    )
    found = []
    for name in wanted:
        path = work / name
        found += (
            [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
        )
    _tarball(out / "artifacts.tar.gz", [(p, p.relative_to(work).as_posix()) for p in found], 8 * MIB)
    files = sorted(p for p in out.iterdir() if p.is_file())
    too_big = [p.name for p in files if p.stat().st_size > 16 * MIB]
    print(
        f"[first light] {out}: {len(files)} file(s), {sum(p.stat().st_size for p in files) / MIB:.1f} MiB", flush=True
    )
    if len(files) > 8 or too_big:
        print(f"[first light] more than 8 files or files over 16 MiB in {out}: {too_big}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="first_light_report.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record")
    r.add_argument("step")
    r.add_argument("status", choices=["pass", "fail", "skip", "timeout"])
    r.add_argument("detail")
    r.add_argument("--seconds", type=float)
    summary_parser = sub.add_parser("summary")
    summary_parser.add_argument("--steps", help="the steps asked for (comma-separated): those not run are named")
    for q in (r, summary_parser, sub.add_parser("pack")):
        q.add_argument("--work", type=Path, required=True)
        q.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.command == "record":
        record(args.work, args.step, args.status, args.detail, args.seconds)
        return 0
    if args.command == "pack":
        pack(args.work, args.out)
        return 0
    return summary(args.work, args.out, args.steps.split(",") if args.steps else None)


if __name__ == "__main__":
    sys.exit(main())
