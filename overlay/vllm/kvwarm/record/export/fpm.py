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
  counter_id           the step's number + 1 in its stream (Dynamo stamps from 1; a skip is a step
                       the trace's writer dropped, recorded in the trace); dp_rank the rank;
                       worker_id "" (no Dynamo runtime), or, where a folder holds several launches
                       of one rank (several DP=1 servers sharing it), the step's launch
  received_at_ns       its launch's started_at plus the step's `at`

The trace is read by record.trace.reader, as validate reads it: every launch of every rank, a
torn last line of a file skipped and reported. Plain data: nothing here imports vLLM.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from ..files import write_atomically
from ..trace.reader import Step, Trace, is_trace, read_trace

FPM_VERSION = 1
FPM_FILE = "fpm.jsonl"


__all__ = ["FPM_FILE", "fpm", "fpm_lines", "is_trace", "write_fpm"]


def fpm(step: Step, worker_id: str = "") -> dict:
    """One step as ForwardPassMetrics (Dynamo's field names and JSON types)."""
    queued = step.queued
    return {
        "version": FPM_VERSION,
        "worker_id": worker_id,
        "dp_rank": step.rank,
        "counter_id": step.number + 1,
        "wall_time": float(step.wall if step.wall is not None else step.span or 0.0),
        "scheduled_requests": {
            "num_prefill_requests": step.prefill_requests,
            "sum_prefill_tokens": step.prefill_new_tokens,
            "var_prefill_length": float(step.prefill_prompt_var),
            "sum_prefill_kv_tokens": step.prefill_prefix_tokens,
            "num_decode_requests": step.decode_requests,
            "sum_decode_kv_tokens": step.decode_kv_tokens,
            "var_decode_kv_tokens": float(step.decode_kv_var),
        },
        "queued_requests": {
            "num_prefill_requests": int(queued["requests"]),
            "sum_prefill_tokens": int(queued["tokens"]),
            "var_prefill_length": float(queued["var"]),
            "num_decode_requests": int(queued["resuming"]),
            "sum_decode_kv_tokens": int(queued["resuming_kv_tokens"]),
            "var_decode_kv_tokens": float(queued["resuming_kv_var"]),
        },
    }


def _epoch_ns(started_at: str) -> int:
    moment = datetime.fromisoformat(started_at)  # Python 3.11 reads the Z
    return int(moment.timestamp()) * 10**9 + moment.microsecond * 1000


def fpm_lines(trace: Trace) -> tuple[list[str], int]:
    """The capture's lines, in the order of the steps' update ends; and the steps left out
    (neither a wall nor a span)."""
    records, left_out = [], 0
    started = {s.index: _epoch_ns(s.header["started_at"]) for s in trace.streams if s.header}
    launches = [s.rank for s in trace.streams if s.header]
    worker = {s.index: s.launch if launches.count(s.rank) > 1 else "" for s in trace.streams}
    for step in trace.steps:
        if step.wall is None and step.span is None:
            left_out += 1
            continue
        at_ns = started[step.stream] + round(step.at * 1e9)
        metrics = fpm(step, worker[step.stream])
        records.append((at_ns, step.rank, step.number, {"received_at_ns": at_ns, "metrics": metrics}))
    records.sort(key=lambda r: r[:3])
    return [json.dumps(r[3], separators=(",", ":")) + "\n" for r in records], left_out


def write_fpm(folder: str | Path, out: str | Path | None = None) -> tuple[Path, int, Trace]:
    """The capture file (default TRACE/fpm.jsonl); returns it, the steps left out and what
    was read (record.trace.reader: every rank, rotated files oldest first, torn last lines
    reported)."""
    trace = read_trace(folder)
    lines, left_out = fpm_lines(trace)
    path = Path(out) if out else trace.root / FPM_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, "".join(lines).encode())
    return path, left_out, trace
