"""The conditions Dynamo's consumers put on an exported file, written out here where their own
code cannot run on it: AIConfigurator's fpm_forward collector (its reader is not installable)
with the stricter ones of Dynamo's worker merge, and the structure of Dynamo's own
self-benchmark artifact (the real ones in tests/fixtures/dynamo-1.6.1). Plain data: no
Dynamo, no vLLM."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dynamo-1.6.1"
SCHEDULED_KEYS = ("num_prefill_requests", "sum_prefill_tokens", "sum_prefill_kv_tokens")


# --- AIConfigurator's collector (collector/fpm_forward/native_artifact.py), and the stricter
# conditions of Dynamo's worker merge (dynamo.vllm.worker_factory), as docs/export.md lists them
def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _fpm_problems(fpm, point: dict, rank: int, where: str) -> list[str]:
    if not isinstance(fpm, dict):
        return [f"{where}: an FPM is an object"]
    problems = []
    wall = fpm.get("wall_time")
    if fpm.get("counter_id") != point["benchmark_id"]:
        problems.append(f"{where}: counter_id == benchmark_id")
    if fpm.get("dp_rank") != rank:
        problems.append(f"{where}: dp_rank == the file's dp.rank")
    if not isinstance(wall, (int, float)) or not math.isfinite(wall) or wall <= 0:
        problems.append(f"{where}: wall_time finite and > 0")
    s = fpm.get("scheduled_requests")
    if not isinstance(s, dict):
        return [*problems, f"{where}: scheduled_requests an object"]
    b, n, k = point["batch_size"], point["total_prefill_tokens"], point["total_kv_read_tokens"]
    if point["point_type"] == "prefill":
        want = {SCHEDULED_KEYS[0]: b, SCHEDULED_KEYS[1]: n, SCHEDULED_KEYS[2]: k}
        want |= {"num_decode_requests": 0, "sum_decode_kv_tokens": 0}
    else:
        want = {SCHEDULED_KEYS[0]: 0, SCHEDULED_KEYS[1]: 0, SCHEDULED_KEYS[2]: 0}
        want |= {"num_decode_requests": b, "sum_decode_kv_tokens": k}
    if any(s.get(key) != value for key, value in want.items()):
        problems.append(f"{where}: scheduled counts equal the point's totals")
    return problems


def collector_problems(files: list[dict], kind: str, dp: int) -> list[str]:
    """Every condition the collector (and the worker's merge) puts on one cell's rank files
    that the files do not meet; [] when they pass."""
    problems: list[str] = []

    def need(ok, what):
        if not ok:
            problems.append(what)

    by_rank: dict = {}
    for f in files:
        rank = (f.get("dp") or {}).get("rank")
        w = f"rank {rank}"
        need(f.get("schema_version") == 2, f"{w}: schema_version 2")
        need(f.get("artifact_type") == "rank", f'{w}: artifact_type "rank"')
        need(f.get("status") == "complete", f"{w}: status complete")
        for flag in ("valid", "usable", "timing_valid"):
            need(f.get(flag) is True, f"{w}: {flag} true")
        need(f.get("stop_reason") is None, f"{w}: stop_reason null")
        need(f.get("error") is None, f"{w}: error null")
        need(f.get("skipped_points") == [], f"{w}: skipped_points == []")
        need(f.get("missing_phases") == [], f"{w}: missing_phases == []")
        need((f.get("config") or {}).get("mode") == kind, f"{w}: config.mode == the cell's kind")
        coverage, results, groups = f.get("coverage") or {}, f.get("results") or [], f.get("iteration_groups") or []
        expected = coverage.get("expected_points")
        need(_count(expected) and expected >= 1, f"{w}: coverage.expected_points an int >= 1")
        need(coverage.get("completed_points") == expected, f"{w}: completed_points == expected_points")
        need(coverage.get("skipped_points") == 0, f"{w}: coverage.skipped_points == 0")
        need(len(results) == len(groups) == expected, f"{w}: one result and one group per expected point")
        need((f.get("dp") or {}).get("size") == dp, f"{w}: dp.size == the cell's dp")
        need(_count(rank), f"{w}: dp.rank an int")
        need(rank not in by_rank, f"{w}: no duplicate rank")
        by_rank[rank] = f
        for key in ("run_id", "grid_digest"):
            need(isinstance(f.get(key), str) and f[key], f"{w}: {key} a non-empty string")
        timing = f.get("timing") or {}
        elapsed, measured = timing.get("benchmark_elapsed_seconds"), timing.get("measured_iteration_seconds")
        finite = all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in (elapsed, measured))
        need(finite, f"{w}: timing seconds finite and >= 0")
        need(finite and measured <= elapsed + 1e-12, f"{w}: measured_iteration_seconds <= benchmark_elapsed_seconds")
        need(
            isinstance(timing.get("started_at"), str) and isinstance(timing.get("completed_at"), str),
            f"{w}: timing.started_at and completed_at strings",
        )
        for i, result in enumerate(results, start=1):
            point = result.get("point")
            where = f"{w}: results[{i - 1}]"
            keys = ("point_type", "benchmark_id", "total_prefill_tokens", "total_kv_read_tokens", "batch_size")
            if not isinstance(point, dict) or not all(key in point for key in keys):
                problems.append(f"{where}: a point with {', '.join(keys)}")
                continue
            need(point["point_type"] == kind, f"{where}: point_type == the cell's kind")
            need(point["benchmark_id"] == i, f"{where}: benchmark_id follows file order from 1")
            need(point["batch_size"] >= 1 and point["total_kv_read_tokens"] >= 0, f"{where}: totals in range")
            if kind == "prefill":
                need(point["total_prefill_tokens"] >= 1, f"{where}: a prefill point computes tokens")
            else:
                need(point["total_prefill_tokens"] == 0, f"{where}: a decode point computes no prefill")
            fpms = result.get("fpms") or []
            need(len(fpms) == 1, f"{where}: exactly one FPM")
            problems += _fpm_problems(fpms[0], point, rank, f"{where}.fpms[0]") if fpms else []
    need(set(by_rank) == set(range(dp)), f"the ranks are exactly 0..{dp - 1}")
    ordered = [by_rank[r] for r in sorted(by_rank, key=str)]
    for f in ordered[1:]:
        for key in ("run_id", "grid_digest"):
            need(f.get(key) == ordered[0].get(key), f"{key} equal across ranks")
        need([r.get("point") for r in f["results"]] == [r.get("point") for r in ordered[0]["results"]], "same points")
        need(f.get("iteration_groups") == ordered[0].get("iteration_groups"), "iteration_groups equal across ranks")
    for f in ordered:
        total = 0.0
        for i, group in enumerate(f.get("iteration_groups") or [], start=1):
            where = f"rank {f['dp']['rank']}: iteration_groups[{i - 1}]"
            need(group.get("benchmark_id") == i, f"{where}: benchmark_id == its place")
            need(group.get("point") == f["results"][i - 1].get("point"), f"{where}: point == the rank's point")
            need(group.get("expected_dp_ranks") == list(range(dp)), f"{where}: expected_dp_ranks == 0..dp-1")
            need(group.get("complete") is True, f"{where}: complete")
            rank_results = group.get("rank_results") or []
            need([rr.get("dp_rank") for rr in rank_results] == list(range(dp)), f"{where}: rank_results in rank order")
            walls = []
            for rr in rank_results:
                fpms, r = rr.get("fpms") or [], rr.get("dp_rank")
                need(len(fpms) == 1, f"{where}: one FPM per rank")
                if fpms and r in by_rank:
                    problems += _fpm_problems(fpms[0], group["point"], r, f"{where}.rank {r}")
                    need(fpms[0] == by_rank[r]["results"][i - 1]["fpms"][0], f"{where}: the rank's own FPM")
                    walls.append(fpms[0].get("wall_time"))
            wall = group.get("wall_time")
            need(walls and math.isclose(wall, max(walls), rel_tol=1e-9, abs_tol=1e-12), f"{where}: wall = ranks' max")
            need(walls and wall == max(walls), f"{where}: wall == the ranks' max exactly (the worker's merge)")
            total += wall if isinstance(wall, (int, float)) else 0.0
        measured = (f.get("timing") or {}).get("measured_iteration_seconds")
        need(
            isinstance(measured, float) and math.isclose(measured, total, rel_tol=1e-9, abs_tol=1e-12),
            f"rank {f['dp']['rank']}: measured_iteration_seconds == the sum of the group wall times",
        )
    return problems


# --- the structure of Dynamo's own artifact ------------------------------------------------
# Where Dynamo writes another JSON type than in the fixtures (null there): from its source.
ALTERNATES = {
    "stop_reason": {"null", "string"},
    "error": {"null", "string"},
    "config.max_batch_size": {"null", "integer"},
    "synchronization.port": {"null", "integer"},
    "recurrent_state.policy": {"null", "string"},
    "recurrent_state.uniform_bound": {"null", "number"},
    "kvwarm.skip_reason": {"null", "string"},
    "kvwarm.dataset": {"null", "object"},
    **{
        f"{where}.point.{key}": types_
        for where in ("results[]", "iteration_groups[]")
        for key, types_ in (
            ("expected_capture_size", {"null", "integer"}),
            ("padding_tokens", {"null", "integer"}),
            ("partition", {"null", "object"}),
            ("rows", {"null", "array"}),
        )
    },
}


def json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def key_paths(doc, prefix: str = "", out: dict | None = None) -> dict[str, set[str]]:
    out = {} if out is None else out
    out.setdefault(prefix, set()).add(json_type(doc))
    if isinstance(doc, dict):
        for key, value in doc.items():
            key_paths(value, f"{prefix}.{key}" if prefix else key, out)
    elif isinstance(doc, list):
        for item in doc:
            key_paths(item, f"{prefix}[]", out)
    return out


def structure_problems(theirs: dict, ours: dict) -> list[str]:
    """Every key path of Dynamo's artifact that ours lacks, or holds with another JSON type
    (null allowed where the export says in kvwarm_sweep.unfilled that it cannot fill it)."""
    mine = key_paths(ours)
    unfilled = {re.sub(r"\[\d+\]", "[]", p) for p in ours["kvwarm_sweep"]["unfilled"]}
    problems = []
    for path, their_types in key_paths(theirs).items():
        if not path:
            continue
        parent = path.rsplit("[]", 1)[0] if path.endswith("]") or "[]." in path else None
        if parent is not None and mine.get(parent) == {"array"} and not any(p.startswith(parent + "[]") for p in mine):
            continue  # an array of ours that is empty: no element to compare
        if any(path.startswith((u + ".", u + "[]")) for u in unfilled if mine.get(u) == {"null"}):
            continue  # inside a block the export cannot fill (null, and said so)
        if path not in mine:
            problems.append(f"{path}: missing")
            continue
        allowed = ALTERNATES.get(path, their_types) | ({"null"} if path in unfilled else set())
        if not mine[path] <= allowed:
            problems.append(f"{path}: {sorted(mine[path])} where Dynamo writes {sorted(allowed)}")
    return problems


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())
