"""`python -m vllm.kvwarm export TRACE --to fpm [--out PATH]`: a served-step trace as
Dynamo's forward-pass metrics (FPM), in the file Dynamo's own capture writes
(`python -m dynamo.common.recv_forward_pass_metrics --output fpm.jsonl`): compact JSON
lines `{"received_at_ns": <Unix ns>, "metrics": <ForwardPassMetrics>}`, so tools that learn
from live FPMs (the planner's regression models) read a trace as they read a capture.

One FPM per traced step of every rank, in the order of their update ends:
  wall_time            the step's `wall` (one update end to the next, the basis Dynamo's own
                       scheduler measures in steady state); after an idle wait, where the trace
                       has no wall, its `span` (schedule() to update end), as Dynamo falls back
                       to; a step with neither is left out and counted
  scheduled_requests   the step's decode and prefill parts (var_prefill_length: the prompt
                       lengths' variance, as Dynamo's field means)
  queued_requests      the queue the step's schedule() left: prefill (its prompt tokens) and
                       preempted requests to resume
  counter_id           the rank's step number + 1 (Dynamo stamps from 1; a gap is a step the
                       trace's writer dropped); worker_id "" (no Dynamo runtime), dp_rank the rank
  received_at_ns       the header's started_at plus the step's `at`

A torn last line of a file is skipped and reported. Plain data: nothing here imports vLLM.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from . import vocabulary as v
from .files import write_atomically

FPM_VERSION = 1
FPM_FILE = "fpm.jsonl"
_FILE = re.compile(r"^trace-dp(\d+)(?:\.(\d+))?\.jsonl$")


class TraceExportError(ValueError):
    pass


@dataclass
class TraceLines:
    """A trace folder's step records per rank, oldest first, with each rank's header."""

    headers: dict[int, dict] = field(default_factory=dict)
    steps: list[tuple[int, dict]] = field(default_factory=list)  # (rank, record)
    torn: list[str] = field(default_factory=list)


def is_trace(folder: Path) -> bool:
    return folder.is_dir() and any(_FILE.match(p.name) for p in folder.iterdir())


def read_lines(folder: Path) -> TraceLines:
    """Every rank's files, the rotated ones first (highest number: the oldest)."""
    files: dict[int, list[tuple[int, Path]]] = {}
    for path in folder.iterdir():
        match = _FILE.match(path.name)
        if match:
            files.setdefault(int(match.group(1)), []).append((int(match.group(2) or 0), path))
    if not files:
        raise TraceExportError(f"{folder}: no trace-dp<R>.jsonl here; pass the folder the trace setting wrote")
    read = TraceLines()
    for rank in sorted(files):
        for _, path in sorted(files[rank], key=lambda f: f[0] or -1, reverse=True):
            lines = path.read_text().splitlines()
            for number, text in enumerate(lines, start=1):
                try:
                    record = json.loads(text)
                except json.JSONDecodeError:
                    if number == len(lines):
                        read.torn.append(f"{path}: line {number}")
                        continue
                    raise TraceExportError(f"{path}: line {number} is not JSON (only a file's last line can be torn)")
                if number == 1:
                    if not isinstance(record, dict) or record.get("type") != v.TRACE_TYPE:
                        raise TraceExportError(f"{path}: line 1 is not a kvwarm trace header")
                    read.headers.setdefault(rank, record)
                else:
                    read.steps.append((rank, record))
    return read


def _float(value) -> float:
    return float(value or 0.0)


def fpm(rank: int, step: dict) -> dict:
    """One step as ForwardPassMetrics (Dynamo's field names and JSON types)."""
    decode, prefill, queued = step["decode"], step["prefill"], step.get("queued") or {}
    return {
        "version": FPM_VERSION,
        "worker_id": "",
        "dp_rank": rank,
        "counter_id": int(step["step"]) + 1,
        "wall_time": _float(step["wall"] if step["wall"] is not None else step.get("span")),
        "scheduled_requests": {
            "num_prefill_requests": int(prefill["requests"]),
            "sum_prefill_tokens": int(prefill["new_tokens"]),
            "var_prefill_length": _float(prefill.get("prompt_var")),
            "sum_prefill_kv_tokens": int(prefill["prefix_tokens"]),
            "num_decode_requests": int(decode["requests"]),
            "sum_decode_kv_tokens": int(decode["kv_tokens"]),
            "var_decode_kv_tokens": _float(decode.get("kv_var")),
        },
        "queued_requests": {
            "num_prefill_requests": int(queued.get("requests", 0)),
            "sum_prefill_tokens": int(queued.get("tokens", 0)),
            "var_prefill_length": _float(queued.get("var")),
            "num_decode_requests": int(queued.get("resuming", 0)),
            "sum_decode_kv_tokens": int(queued.get("resuming_kv_tokens", 0)),
            "var_decode_kv_tokens": _float(queued.get("resuming_kv_var")),
        },
    }


def _epoch_ns(started_at: str) -> int:
    moment = datetime.fromisoformat(started_at)  # Python 3.11 reads the Z
    return int(moment.timestamp()) * 10**9 + moment.microsecond * 1000


def fpm_lines(trace: TraceLines) -> tuple[list[str], int]:
    """The capture's lines, in the order of the steps' update ends; and the steps left out
    (neither a wall nor a span)."""
    records, left_out = [], 0
    for rank, step in trace.steps:
        if step.get("wall") is None and step.get("span") is None:
            left_out += 1
            continue
        at_ns = _epoch_ns(trace.headers[rank]["started_at"]) + round(float(step["at"]) * 1e9)
        records.append((at_ns, rank, step["step"], {"received_at_ns": at_ns, "metrics": fpm(rank, step)}))
    records.sort(key=lambda r: r[:3])
    return [json.dumps(r[3], separators=(",", ":")) + "\n" for r in records], left_out


def write_fpm(folder: str | Path, out: str | Path | None = None) -> tuple[Path, int, TraceLines]:
    """The capture file (default TRACE/fpm.jsonl); returns it, the steps left out and what was read."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TraceExportError(f"{folder}: not a folder; pass the folder the trace setting wrote (kvwarm_trace.out)")
    trace = read_lines(folder)
    lines, left_out = fpm_lines(trace)
    path = Path(out) if out else folder / FPM_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, "".join(lines).encode())
    return path, left_out, trace
