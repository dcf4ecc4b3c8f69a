"""Served-step traces and sweep tables made by hand for tests: a trace folder written as the
recorder's JSON lines (the format of docs/validate-reference.md: version 1's composed lines,
`step`, and version 2's raw numbers, `raw_step`, as the recorder writes now; plain data), and
a table written by the sweep's own artifact writer. Both carry the same provenance unless a
test changes a field of one."""

from __future__ import annotations

import copy
import json
from pathlib import Path

MODEL = "/models/tiny-qwen3-moe"
BUILD = {
    "schema": 1,
    "version": "9.9.1+kvwarm.3",
    "release": "9.9.1",
    "flavour": "cpu",
    "series_digest": "d" * 64,
    "overlay_digest": "e" * 64,
    "revision": "abc1234",
}
RESOLVED = {
    "block_sizes": {"0:FullAttentionSpec": 16},
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "max_model_len": 2048,
    "dtype": "float32",
    "kv_cache_dtype": "auto",
    "enable_prefix_caching": True,
    "mamba_cache_mode": None,
    "enforce_eager": True,
    "cudagraph_mode": None,
    "cudagraph_capture_sizes": [],
    "num_gpu_blocks": 4000,
    "kv_cache_tokens": 64000,
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "async_scheduling": False,
    "enable_chunked_prefill": True,
    "long_prefill_token_threshold": 0,
    "distributed_executor_backend": "mp",  # what a CPU server resolves to
}
HARDWARE = {"cpu": "AMD EPYC 7B13", "cores": 2, "gpus": [], "driver": None, "cuda_runtime": None, "python": "3.12"}
LAYOUT = {
    "data_parallel_size": 1,
    "data_parallel_rank": 0,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "expert_parallel": False,
}
GIVEN = ["--model", MODEL, "--dtype", "float32", "--max-num-batched-tokens", "256"]


def header(rank: int = 0, dp_size: int = 1, loop: str = "sync", **changes) -> dict:
    """A trace file's first line (format version 1 unless `schema_version` is changed);
    `changes` replace top-level fields, `resolved` entries update the resolved engine
    arguments."""
    resolved = {**RESOLVED, **changes.pop("resolved", {}), "async_scheduling": loop == "batch_queue"}
    h = {
        "type": "kvwarm_trace",
        "schema_version": 1,
        "rank": rank,
        "dp_size": dp_size,
        "started_at": "2026-12-01T10:00:00Z",
        "model": MODEL,
        "build": copy.deepcopy(BUILD),
        "engine": {"given": list(GIVEN), "resolved": resolved},
        "layout": {**LAYOUT, "data_parallel_size": dp_size, "data_parallel_rank": rank},
        "hardware": dict(HARDWARE),
        "torch": "2.13.0+cpu",
        "engine_loop": {"loop": loop, "async_scheduling": loop == "batch_queue"},
        "timing": {"basis": "update_to_update", "clock": "perf_counter"},
    }
    h.update(changes)
    return h


def step(
    n: int,
    wall_ms: float | None,
    decode: tuple[int, int] = (0, 0),
    prefill: tuple[int, int, int] = (0, 0, 0),
    forward_ms: float | None = None,
    spec_tokens: int = 0,
    graph: dict | None = None,
    span_ms: float | None = None,
    continuations: int = 0,
) -> dict:
    """One step line: decode (requests, kv_tokens), prefill (requests, new_tokens, prefix_tokens);
    `span_ms`: its own schedule() to its update (none: the line has no span); `continuations`:
    the prefill chunks that continue their prompt."""
    wall = None if wall_ms is None else wall_ms / 1e3
    forward = (wall_ms * 0.8 if forward_ms is None else forward_ms) / 1e3 if wall_ms is not None else 0.0
    return {
        "step": n,
        "at": 0.01 * (n + 1),
        "wall": wall,
        **({"span": span_ms / 1e3} if span_ms is not None else {}),
        "phases": {"schedule": 0.0001, "forward": forward, "update": 0.0001, "sweep": 0.0, "other": 0.0},
        "decode": {"requests": decode[0], "kv_tokens": decode[1], "kv_var": 0.0},
        "prefill": {
            "requests": prefill[0],
            "new_tokens": prefill[1],
            "prefix_tokens": prefill[2],
            "new_var": 0.0,
            "continuations": continuations,
        },
        "spec_tokens": spec_tokens,
        "queued": {"requests": 0, "tokens": 0},
        "preempted": 0,
        "graph": graph or {"mode": None, "padded_tokens": None},
    }


def raw_step(
    n: int,
    wall_ms: float | None,
    new: list[list[int]] = (),
    cached: list[tuple[int, int, int]] = (),
    span_ms: float | None = None,
    gap_ms: float | None = None,
    spec: list[int] | None = None,
    resumed: list[int] | None = None,
    preempted: int = 0,
    queued: list[int] | None = None,
    graph: list | None = None,
    untimed: str | None = None,
) -> dict:
    """One step line of format version 2, as served.sink writes it: `new`, [prompt length,
    tokens computed before, tokens scheduled] per new request; `cached`, (computed,
    scheduled, prompt) per request scheduled again (a request first seen mid-prompt carries
    the prompt the sink guessed); `spec`, speculative tokens per cached request; `resumed`,
    positions in `cached` of preempted requests resuming; `gap_ms`, the previous update's end
    to this schedule(); `graph`, [mode, padded tokens]; `untimed`, why it has no wall."""
    wall = None if wall_ms is None else wall_ms / 1e3
    forward = 0.0 if wall_ms is None else wall_ms * 0.8 / 1e3
    line = {
        "step": n,
        "at": 0.01 * (n + 1),
        "wall": wall,
        "span": None if span_ms is None else span_ms / 1e3,
        "phases": {"schedule": 0.0001, "forward": forward, "update": 0.0001, "sweep": 0.0, "other": 0.0},
        "new": [list(r) for r in new],
        "cached": {
            "computed": [c[0] for c in cached],
            "scheduled": [c[1] for c in cached],
            "prompt": [c[2] for c in cached],
        },
        "queued": list(queued or [0] * 6),
        "outputs": 1,
        "gc": [0, 0.0],
    }
    line.update({"gap": gap_ms / 1e3} if gap_ms is not None else {})  # none: a trace without the field
    if spec is not None:
        line["spec"], line["spec_tokens"] = list(spec), sum(spec)
    line.update({"resumed": list(resumed)} if resumed else {})
    line.update({"preempted": preempted} if preempted else {})
    line.update({"graph": list(graph)} if graph is not None else {})
    line.update({"untimed": untimed} if untimed else {})
    return line


def write_trace(
    folder: Path, steps: list[dict], head: dict | None = None, rank: int = 0, rotation: int = 0, tail: str = ""
) -> Path:
    """One trace file (trace-dp<R>.jsonl, or its rotated trace-dp<R>.<k>.jsonl): the header,
    the steps, and `tail` appended as it is (e.g. a torn line)."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"trace-dp{rank}.{rotation}.jsonl" if rotation else f"trace-dp{rank}.jsonl"
    lines = [json.dumps(head or header(rank))] + [json.dumps(s) for s in steps]
    path = folder / name
    path.write_text("\n".join(lines) + "\n" + tail)
    return path


def write_table(out: Path, rows: list, resolved: dict | None = None, model: str = MODEL, **fields) -> Path:
    """A sweep's --out folder holding one rank's sweep.json of `rows` (PointRow), made by the
    sweep's own writer with the provenance the traces carry; `fields` replace top-level fields."""
    from vllm.kvwarm.record.artifact import KvwarmMeta, build_artifact, write_artifact

    run = {
        "started_at": "2026-12-01T11:00:00Z",
        "finished_at": "2026-12-01T11:10:00Z",
        "build": copy.deepcopy(BUILD),
        "torch": "2.13.0+cpu",
        "hardware": dict(HARDWARE),
        "engine_args": {"given": list(GIVEN), "resolved": {**RESOLVED, **(resolved or {})}},
    }
    artifact = build_artifact(
        rows,
        KvwarmMeta(enabled=True, warm_eligible=True, giant_kv_repeats=3),
        {"points": str(out / "grid.json"), "model": model},
        "complete",
        run=run,
        layout=dict(LAYOUT),
    )
    artifact.update(fields)
    write_artifact(out, artifact)
    return out
