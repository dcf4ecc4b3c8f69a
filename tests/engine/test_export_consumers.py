"""The exports read by Dynamo's own code (ai-dynamo 1.6.1, unchanged): every FPM decodes as
the planner's ForwardPassMetrics (msgspec, strict), the planner's readers give the rows back
from the artifact and from the profiler's folder, its regression models fit them; plus the
AIConfigurator fpm_forward collector's conditions on the files (its reader is not installable,
so they are checked here, as docs/export.md lists them) and the structure of the real
self-benchmark artifacts in tests/fixtures/dynamo-1.6.1.

Runs in the consumers venv (`nox -s consumers-S`): ai-dynamo --no-deps, msgspec, numpy,
scikit-learn, pydantic; no vLLM, the overlay's record room on the path (plain data). The
sweeps here are made with the record's own builder (decode and prefill, one and two ranks);
the real CPU sweeps come from tests/engine/test_export_sweeps.py through KVWARM_EXPORTS.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import re
import shutil
import sys
import types
from pathlib import Path

import pytest

pytestmark = pytest.mark.consumers

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dynamo-1.6.1"
EXPORTS_ENV = "KVWARM_EXPORTS"
SCHEDULED_KEYS = ("num_prefill_requests", "sum_prefill_tokens", "sum_prefill_kv_tokens")


def skip_where_not_made(folder: Path) -> None:
    """The real sweeps skipped on this host (-m export says why in the folder): so do these."""
    from kvwarm_testing.engine import EXPORTS_SKIPPED

    if (folder / EXPORTS_SKIPPED).is_file():
        pytest.skip(f"the real sweeps were not made here: {(folder / EXPORTS_SKIPPED).read_text()}")


# --- Dynamo's code -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dynamo():
    """The planner's readers and models, without running the package __init__ files that
    reach the Kubernetes connectors and aisimulate (not installable here)."""
    spec = importlib.util.find_spec("dynamo.common")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("dynamo.common is not importable: run these tests through `nox -s consumers-S`")
    root = Path(next(iter(spec.submodule_search_locations))).parent
    for name in ("dynamo.planner", "dynamo.planner.core", "dynamo.planner.core.perf_model"):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            sys.modules[name] = module
    import msgspec
    from dynamo.common.forward_pass_metrics import ForwardPassMetrics
    from dynamo.planner.config.defaults import SubComponentType
    from dynamo.planner.core.perf_model.decode import DecodeRegressionModel
    from dynamo.planner.core.perf_model.prefill import PrefillRegressionModel
    from dynamo.planner.monitoring import perf_metrics

    return types.SimpleNamespace(
        msgspec=msgspec,
        FPM=ForwardPassMetrics,
        kinds={"prefill": SubComponentType.PREFILL, "decode": SubComponentType.DECODE},
        Decode=DecodeRegressionModel,
        Prefill=PrefillRegressionModel,
        extract=perf_metrics._extract_fpms_from_benchmark,
        convert=perf_metrics._convert_profiling_data_to_fpms,
    )


# --- sweeps made with the record's builder --------------------------------------------------
RESOLVED = {
    "block_sizes": {"0:FullAttentionSpec": 32},
    "max_num_seqs": 8,
    "max_num_batched_tokens": 2048,
    "max_model_len": 2048,
    "dtype": "float32",
    "kv_cache_dtype": "auto",
    "enable_prefix_caching": True,
    "mamba_cache_mode": None,
    "enforce_eager": True,
    "cudagraph_mode": "CUDAGraphMode.NONE",
    "cudagraph_capture_sizes": [],
    "num_gpu_blocks": 4096,
    "kv_cache_tokens": 4096 * 32,
}
DECODE_POINTS = [(c * b, b) for b in (1, 2, 4, 8) for c in (64, 256, 1000)]
PREFILL_POINTS = [(n, 0, 1) for n in (64, 256, 512, 1024, 2048)] + [(512, 1024, 2), (256, 512, 1)]  # N, P, B
JITTER = 0.02  # each made sample is its law's time within +-2 %


def decode_law(b: int, k: int) -> float:
    return 4e-3 + 3e-4 * b + 5e-7 * k


def prefill_law(n: int, p: int) -> float:
    return 3e-3 + 4e-5 * n + 1e-5 * p


def _samples(rng, seconds: float, count: int) -> list[float]:
    return [seconds * (1 + rng.uniform(-JITTER, JITTER)) for _ in range(count)]


def made_rows(kinds=("decode",), rank: int = 0, skipped: bool = False):
    from vllm.kvwarm.record import vocabulary as v
    from vllm.kvwarm.record.artifact import PointRow

    rng = random.Random(rank)
    rows = []
    if "decode" in kinds:
        for k, b in DECODE_POINTS:
            times = _samples(rng, decode_law(b, k), 5)
            rows.append(PointRow(k, b, v.REAL_KV, [v.STAMP_REAL_KV], times, sorted(times)[len(times) // 2]))
    if "prefill" in kinds:
        for n, p, b in PREFILL_POINTS:
            times = _samples(rng, prefill_law(n, p), 3)
            regime, stamps = (v.REAL_PREFIX, [v.STAMP_PREFILL_REAL_SEED]) if p else (v.NOT_APPLICABLE, [])
            rows.append(
                PointRow(p, b, regime, stamps, times, sorted(times)[1], point_type=v.PREFILL, total_prefill_tokens=n)
            )
    if skipped:
        rows.append(PointRow(96, 3, v.skip_regime(v.POINT_SKIP_REASON), detail="chain_too_shallow: 40 < 96"))
    return rows


def made_sweep(root: Path, kinds=("decode",), dp: int = 1, skipped: bool = False, status: str = "complete") -> Path:
    """A sweep's --out folder as the sweep writes it: one rank's sweep.json, or under data
    parallel dp<R>/sweep.json and the combined view."""
    from vllm.kvwarm.record.artifact import KvwarmMeta, build_artifact
    from vllm.kvwarm.record.combined import write_combined

    meta = KvwarmMeta(
        enabled=True,
        warm_eligible=True,
        dataset={"path": "/data/sharegpt.json", "sha256": "0" * 64, "collection_pool": "even", "conversations": 32},
        stages=[{"batch": 8, "depth": 1010, "build_seconds": 0.5}],
        giant_kv_repeats=5,
        giant_kv_threshold=1_000_000,
        global_batch_factor=dp,
    )
    for rank in range(dp):
        layout = {
            "data_parallel_size": dp,
            "data_parallel_rank": rank,
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "expert_parallel": dp == 1,
        }
        run = {
            "started_at": "2026-12-02T09:00:00Z",
            "finished_at": "2026-12-02T09:00:03Z",
            "build": {"version": "1.0.0+kvwarm.1"},
            "engine_args": {"given": ["--model", "/models/tiny-moe"], "resolved": RESOLVED},
        }
        error = "RuntimeError: the engine stopped" if status == "failed" else None
        artifact = build_artifact(
            made_rows(kinds, rank, skipped),
            meta,
            {"points": "points.json", "model": "/models/tiny-moe"},
            status,
            error,
            run=run,
            layout=layout,
        )
        folder = root / f"dp{rank}" if dp > 1 else root
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "sweep.json").write_text(json.dumps(artifact))
    if dp > 1:
        write_combined(root, dp)
    return root


def export_dynamo(root: Path, out: Path, kind: str | None = None) -> list[Path]:
    from vllm.kvwarm.record.export.input import load_sweep
    from vllm.kvwarm.record.export.write import write_dynamo

    return write_dynamo(load_sweep(root), out, kind)


def export_profiler(root: Path, out: Path) -> list[Path]:
    from vllm.kvwarm.record.export.input import load_sweep
    from vllm.kvwarm.record.export.write import write_profiler

    return write_profiler(load_sweep(root), out)


def load(paths) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in paths]


def sweep_rows(root: Path) -> list[list[dict]]:
    """Each rank's measured rows, from the sweep's own record."""
    from vllm.kvwarm.record.export.input import load_sweep

    return [a["results"] for a in load_sweep(root).ranks]


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


# --- the checks, shared by made and real sweeps --------------------------------------------
def check_fpms_decode(dynamo, files: list[dict]) -> int:
    """Every FPM of every file decodes strictly, and the struct holds the file's values."""
    count = 0
    for f in files:
        fpms = [x for r in f["results"] for x in r["fpms"]]
        fpms += [x for g in f["iteration_groups"] for rr in g["rank_results"] for x in rr["fpms"]]
        for raw in fpms:
            fpm = dynamo.msgspec.json.decode(json.dumps(raw).encode(), type=dynamo.FPM)
            assert dynamo.msgspec.to_builtins(fpm) == {k: raw[k] for k in dynamo.msgspec.to_builtins(fpm)}
            count += 1
    return count


def check_planner_reads_rows(dynamo, files: list[dict], rows: list[list[dict]], kind: str) -> list:
    """_extract_fpms_from_benchmark on each rank's file: one FPM per row of the kind, with its
    counts and its median; none of the other kind."""
    other = "prefill" if kind == "decode" else "decode"
    fpms = []
    for rank, f in enumerate(files):
        got = dynamo.extract(f, dynamo.kinds[kind])
        assert dynamo.extract(f, dynamo.kinds[other]) == []
        want = sorted(
            (r["point"]["batch_size"], r["point"]["total_kv_read_tokens"], r["point"]["total_prefill_tokens"])
            + (r["median_seconds"],)
            for r in rows[rank]
            if r["point"].get("point_type", "decode") == kind
        )
        s = [x.scheduled_requests for x in got]
        if kind == "decode":
            seen = sorted((x.num_decode_requests, x.sum_decode_kv_tokens, 0, m.wall_time) for x, m in zip(s, got))
        else:
            seen = sorted(
                (x.num_prefill_requests, x.sum_prefill_kv_tokens, x.sum_prefill_tokens, m.wall_time)
                for x, m in zip(s, got)
            )
        assert seen == want
        fpms += got
    return fpms


def check_profiler_reads_rows(dynamo, folder: Path, rows: list[list[dict]], tmp_path: Path) -> None:
    """_convert_profiling_data_to_fpms on the exported folder, from the npz files and then
    from the JSON fallbacks alone: the decode rows (slowest rank's median) and the prefill
    rows of one request without prefix."""
    by_point: dict[tuple, float] = {}
    for rank_rows in rows:
        for r in rank_rows:
            p = r["point"]
            key = (p.get("point_type", "decode"), p["batch_size"], p["total_kv_read_tokens"], p["total_prefill_tokens"])
            by_point[key] = max(by_point.get(key, 0.0), r["median_seconds"])
    decode = sorted((b, k, t) for (kind, b, k, _), t in by_point.items() if kind == "decode")
    prefill = sorted((n, t) for (kind, b, k, n), t in by_point.items() if kind == "prefill" and b == 1 and k == 0)
    fallback = tmp_path / "json-only"
    shutil.copytree(folder, fallback)
    for npz in fallback.rglob("raw_data.npz"):
        npz.unlink()
    for source in (folder, fallback):
        got = dynamo.convert(str(source), dynamo.kinds["decode"]) if decode else []
        seen = sorted(
            (x.scheduled_requests.num_decode_requests, x.scheduled_requests.sum_decode_kv_tokens) for x in got
        )
        assert seen == [(b, k) for b, k, _ in decode]
        walls = sorted(
            (x.scheduled_requests.num_decode_requests, x.scheduled_requests.sum_decode_kv_tokens, x.wall_time)
            for x in got
        )
        assert all(math.isclose(w, t, rel_tol=1e-12) for (_, _, w), (_, _, t) in zip(walls, decode))
        got = dynamo.convert(str(source), dynamo.kinds["prefill"]) if prefill else []
        seen = sorted((x.scheduled_requests.sum_prefill_tokens, x.wall_time) for x in got)
        assert [n for n, _ in seen] == [n for n, _ in prefill]
        assert all(math.isclose(w, t, rel_tol=1e-12) for (_, w), (_, t) in zip(seen, prefill))
        assert {x.scheduled_requests.num_prefill_requests for x in got} <= {1}


def residuals(model, fpms, kind: str) -> list[float]:
    """The fitted model's prediction minus each FPM's wall time (seconds)."""
    model.load_benchmark_fpms(fpms)
    assert model._ensure_fitted(), f"the {kind} model did not fit its {len(fpms)} FPMs"
    if kind == "decode":
        predict = [
            model._predict_2d(f.scheduled_requests.num_decode_requests, f.scheduled_requests.sum_decode_kv_tokens)
            for f in fpms
        ]
    else:
        predict = [model._predict_wall_time(f.scheduled_requests.sum_prefill_tokens) for f in fpms]
    return [p - f.wall_time for p, f in zip(predict, fpms)]


# --- made sweeps ---------------------------------------------------------------------------
CASES = {  # name: (kinds, dp, the fixture of the same shape per kind)
    "decode": (("decode",), 1, {"decode": ["benchmark_decode.json"]}),
    "prefill": (("prefill",), 1, {"prefill": ["benchmark_prefill.json", "benchmark_prefill_fake.json"]}),
    "decode_dp2": (("decode",), 2, {"decode": ["benchmark_decode_2rank.json", "benchmark_decode_2rank_dp1.json"]}),
    "both": (("decode", "prefill"), 1, {"decode": ["benchmark_decode.json"], "prefill": ["benchmark_prefill.json"]}),
}


@pytest.fixture(params=sorted(CASES))
def made(request, tmp_path):
    kinds, dp, fixtures = CASES[request.param]
    root = made_sweep(tmp_path / "sweep", kinds, dp)
    written = export_dynamo(root, tmp_path / "dynamo" / "benchmark.json")
    files = {}
    for kind in kinds:
        stem = "benchmark" if len(kinds) == 1 else f"benchmark_{kind}"
        names = [f"{stem}.json", *(f"{stem}_dp{r}.json" for r in range(1, dp))]
        files[kind] = load(tmp_path / "dynamo" / name for name in names)
    assert sorted(written) == sorted(tmp_path / "dynamo" / n for n in os.listdir(tmp_path / "dynamo"))
    return types.SimpleNamespace(root=root, kinds=kinds, dp=dp, files=files, fixtures=fixtures, tmp=tmp_path)


def test_every_exported_fpm_decodes_as_the_planners_struct(dynamo, made):
    counts = {kind: check_fpms_decode(dynamo, files) for kind, files in made.files.items()}
    points = {"decode": len(DECODE_POINTS), "prefill": len(PREFILL_POINTS)}
    assert counts == {kind: points[kind] * made.dp * (1 + made.dp) for kind in made.kinds}
    # the strictness the check relies on: a count written 4.0 is refused
    raw = made.files[made.kinds[0]][0]["results"][0]["fpms"][0]
    bad = {**raw, "scheduled_requests": {**raw["scheduled_requests"], "num_decode_requests": 4.0}}
    with pytest.raises(dynamo.msgspec.ValidationError):
        dynamo.msgspec.json.decode(json.dumps(bad).encode(), type=dynamo.FPM)


def test_the_planners_reader_gives_every_row_back(dynamo, made):
    rows = sweep_rows(made.root)
    for kind, files in made.files.items():
        fpms = check_planner_reads_rows(dynamo, files, rows, kind)
        assert len(fpms) == made.dp * len(DECODE_POINTS if kind == "decode" else PREFILL_POINTS)


def test_the_planners_converter_reads_the_profiler_folder_back(dynamo, made):
    export_profiler(made.root, made.tmp / "profiler")
    check_profiler_reads_rows(dynamo, made.tmp / "profiler", sweep_rows(made.root), made.tmp)


def test_the_regression_models_fit_every_row_the_planner_reads(dynamo, made):
    """The planner's models on every FPM its reader gives, as the planner feeds them (it drops
    none). Rows made from a linear law the model sees, each sample within +-JITTER of it: the
    fit predicts every row within that band plus the median's own jitter. Prefill rows with a
    prefix (P > 0) cost more by a term in P, which the prefill model does not see (N only:
    docs/export.md): the fit over every row cannot hold them, as the planner's cannot; over
    the rows without a prefix it finds their law."""
    for kind, files in made.files.items():
        fpms = [f for data in files for f in dynamo.extract(data, dynamo.kinds[kind])]
        prefixed = [kind == "prefill" and f.scheduled_requests.sum_prefill_kv_tokens > 0 for f in fpms]
        model = dynamo.Decode(64, 5, 16) if kind == "decode" else dynamo.Prefill(64, 5, 16)
        relative = [abs(e) / f.wall_time for e, f in zip(residuals(model, fpms, kind), fpms)]
        if not any(prefixed):
            assert max(relative) <= 2 * JITTER
            continue
        assert max(r for r, p in zip(relative, prefixed) if p) > 2 * JITTER  # what the planner's fit does
        plain = [f for f, p in zip(fpms, prefixed) if not p]
        errors = residuals(dynamo.Prefill(64, 5, 16), plain, kind)
        assert max(abs(e) / f.wall_time for e, f in zip(errors, plain)) <= 2 * JITTER


def test_a_sweep_of_both_kinds_has_both_at_the_path_as_dynamos_agg_mode(dynamo, tmp_path):
    """The file at the path (every rank's) holds both kinds, as Dynamo's agg run writes it:
    the planner takes its component's rows from it; the collector, one kind per cell, does not."""
    root = made_sweep(tmp_path / "sweep", ("decode", "prefill"), 2)
    export_dynamo(root, tmp_path / "d" / "benchmark.json")
    agg = load(tmp_path / "d" / name for name in ("benchmark.json", "benchmark_dp1.json"))
    assert [f["config"]["mode"] for f in agg] == ["agg", "agg"]
    assert check_fpms_decode(dynamo, agg) == 2 * (len(DECODE_POINTS) + len(PREFILL_POINTS)) * 3
    rows = sweep_rows(root)
    for kind, points in (("decode", DECODE_POINTS), ("prefill", PREFILL_POINTS)):
        got = [f for data in agg for f in dynamo.extract(data, dynamo.kinds[kind])]
        assert len(got) == 2 * len(points)
        want = sorted(r["median_seconds"] for rank in rows for r in rank if r["point"].get("point_type") == kind)
        assert sorted(f.wall_time for f in got) == want
    ids = [r["point"]["benchmark_id"] for r in agg[0]["results"]]
    assert ids == list(range(1, len(ids) + 1))  # prefill then decode, numbered on
    assert collector_problems(agg, "decode", 2) != [] and collector_problems(agg, "prefill", 2) != []


def test_a_complete_export_passes_every_condition_of_the_collector(made):
    for kind, files in made.files.items():
        assert collector_problems(files, kind, made.dp) == []
        assert collector_problems(files, "prefill" if kind == "decode" else "decode", made.dp) != []


def test_the_export_has_every_key_of_dynamos_artifact_with_its_json_type(made):
    for kind, names in made.fixtures.items():
        ours = made.files[kind]
        pairs = zip(names, ours) if made.dp > 1 else ((name, ours[0]) for name in names)
        for name, mine in pairs:
            assert structure_problems(fixture(name), mine) == [], name
        for mine in ours:  # what the export says it cannot fill is null, nothing else
            for path in mine["kvwarm_sweep"]["unfilled"]:
                assert _at(mine, path) is None, path


def _at(doc, path: str):
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        doc = doc[int(part[1:-1])] if part.startswith("[") else doc[part]
    return doc


def test_a_skipped_point_or_a_failed_sweep_fails_the_collector_as_dynamos_own_would(tmp_path):
    skipped = made_sweep(tmp_path / "skipped", skipped=True)
    (artifact,) = load(export_dynamo(skipped, tmp_path / "a" / "benchmark.json"))
    assert (artifact["status"], artifact["valid"], artifact["usable"]) == ("complete", False, False)
    assert artifact["coverage"] == {"expected_points": 13, "completed_points": 12, "skipped_points": 1}
    problems = collector_problems([artifact], "decode", 1)
    assert "rank 0: valid true" in problems and "rank 0: skipped_points == []" in problems
    failed = made_sweep(tmp_path / "failed", status="failed")
    (artifact,) = load(export_dynamo(failed, tmp_path / "b" / "benchmark.json"))
    assert (artifact["status"], artifact["valid"], artifact["error"]) == (
        "failed",
        False,
        "RuntimeError: the engine stopped",
    )
    assert "rank 0: error null" in collector_problems([artifact], "decode", 1)


def test_the_probes_own_fixture_passes_the_collector_checks():
    """The checks' own oracle: Dynamo's real rank files pass them."""
    assert collector_problems([fixture("benchmark_decode.json")], "decode", 1) == []
    assert collector_problems([fixture("benchmark_prefill.json")], "prefill", 1) == []
    pair = [fixture("benchmark_decode_2rank.json"), fixture("benchmark_decode_2rank_dp1.json")]
    assert collector_problems(pair, "decode", 2) == []
    assert "the ranks are exactly 0..1" in collector_problems(pair[:1], "decode", 2)


def test_the_checks_see_what_they_check(tmp_path):
    """The oracles' own check: a key removed, a type changed, a wrong counter or group time."""
    import copy

    files = load(export_dynamo(made_sweep(tmp_path / "s", dp=2), tmp_path / "d" / "benchmark.json"))
    theirs = fixture("benchmark_decode_2rank.json")
    broken = copy.deepcopy(files[0])
    del broken["limits"]["block_size"]
    broken["results"][0]["fpms"][0]["counter_id"] = "1"
    assert structure_problems(theirs, broken) == [
        "limits.block_size: missing",
        "results[].fpms[].counter_id: ['integer', 'string'] where Dynamo writes ['integer']",
    ]
    assert "rank 0: results[0].fpms[0]: counter_id == benchmark_id" in collector_problems(
        [broken, files[1]], "decode", 2
    )
    slow = copy.deepcopy(files)
    for f in slow:
        f["iteration_groups"][0]["wall_time"] *= 1.5
    problems = collector_problems(slow, "decode", 2)
    assert "rank 0: iteration_groups[0]: wall == the ranks' max exactly (the worker's merge)" in problems
    assert "rank 1: measured_iteration_seconds == the sum of the group wall times" in problems


# --- the real CPU sweeps -------------------------------------------------------------------
REAL = {
    "dp1": (1, ["benchmark_decode.json"]),
    "dp2": (2, ["benchmark_decode_2rank.json", "benchmark_decode_2rank_dp1.json"]),
}


@pytest.fixture(params=sorted(REAL))
def real(request):
    folder = os.environ.get(EXPORTS_ENV)
    if not folder:
        pytest.skip(f"{EXPORTS_ENV} is not set: `nox -s consumers-S` runs the real sweeps (-m export) first")
    skip_where_not_made(Path(folder))
    work = Path(folder) / request.param
    assert work.is_dir(), f"{work}: the real sweep's exports are missing; see tests/engine/test_export_sweeps.py"
    dp, fixtures = REAL[request.param]
    names = ["benchmark.json", *(f"benchmark_dp{r}.json" for r in range(1, dp))]
    return types.SimpleNamespace(
        work=work,
        dp=dp,
        fixtures=fixtures,
        files=load(work / "dynamo" / n for n in names),
        rows=sweep_rows(work / "sweep"),
    )


def test_a_real_sweeps_export_is_read_by_the_planner_and_passes_the_collector(dynamo, real, tmp_path):
    assert check_fpms_decode(dynamo, real.files) == len(real.rows[0]) * real.dp * (1 + real.dp)
    check_planner_reads_rows(dynamo, real.files, real.rows, "decode")
    check_profiler_reads_rows(dynamo, real.work / "profiler", real.rows, tmp_path)
    assert collector_problems(real.files, "decode", real.dp) == []
    for name, mine in zip(real.fixtures, real.files):
        assert structure_problems(fixture(name), mine) == [], name
        # the engine's parallel settings as vLLM resolved them: no null where Dynamo's artifact
        # of the same engine arguments has a value
        theirs, ours = key_paths(fixture(name)["engine"]["parallel"]), key_paths(mine["engine"]["parallel"])
        valued = {path for path, types_ in theirs.items() if path and "null" not in types_}
        assert sorted(path for path in valued if ours.get(path, {"null"}) == {"null"}) == [], name


def test_the_decode_model_fit_on_a_real_sweep_predicts_its_points_within_the_sweeps_spread(dynamo, real):
    """DecodeRegressionModel (the planner's default sizes) fit on the one-rank sweep's FPMs.
    The bound comes from the sweep's own spread, W = the widest range of timed steps among
    the rows it did not stamp noisy. If the step time is linear in (B, K) and each median lies
    within its point's range, a prediction is off its point's median by at most the fit's
    error (within W) plus the median's own (within W), plus what the planner's clamp of a
    negative num_decode_requests coefficient moves (a coefficient the noise made: within W
    across the batch axis): 3 W. A noisy row (its spread beyond the sweep's noisy_spread: its
    median may be polluted, as the stamp says) stays in the fit, as the planner gets it, and
    is not held to the bound.

    The two-rank sweep is not fitted: its steps (two engine cores and the collectives shim
    on two shared cores) vary more between points than with B and K, which the planner's
    model may reject (a negative coefficient); Dynamo 1.6.1's planner skips the bootstrap from
    FPMs under attention DP > 1 anyway."""
    if real.dp > 1:
        pytest.skip("the two-rank CPU sweep's timings are not a performance surface (see the docstring)")
    fpms = [f for data in real.files for f in dynamo.extract(data, dynamo.kinds["decode"])]
    errors = residuals(dynamo.Decode(64, 5, 16), fpms, "decode")
    rows = {(r["point"]["batch_size"], r["point"]["total_kv_read_tokens"]): r for r in real.rows[0]}
    s = [f.scheduled_requests for f in fpms]
    noisy = ["kvwarm_noisy" in rows[(x.num_decode_requests, x.sum_decode_kv_tokens)]["sample_reasons"] for x in s]
    quiet = [r["max_seconds"] - r["min_seconds"] for r in rows.values() if "kvwarm_noisy" not in r["sample_reasons"]]
    report = {
        "points": len(fpms),
        "noisy_points": sum(noisy),
        "max_abs_error_ms": max(abs(e) for e, n in zip(errors, noisy) if not n) * 1e3,
        "mean_abs_error_ms": sum(abs(e) for e, n in zip(errors, noisy) if not n) / (len(fpms) - sum(noisy)) * 1e3,
        "widest_quiet_range_ms": max(quiet) * 1e3,
        "bound_ms": 3 * max(quiet) * 1e3,
        "median_wall_ms": sorted(f.wall_time for f in fpms)[len(fpms) // 2] * 1e3,
    }
    print(f"decode fit on {real.work.name}: {json.dumps(report)}")
    assert report["max_abs_error_ms"] <= report["bound_ms"], report


# --- a served-step trace as Dynamo's forward-pass metrics capture ---------------------------
def made_trace_lines(root: Path) -> Path:
    """A two-rank trace in the recorder's format (docs/validate-reference.md#the-trace), written here:
    decode, prefill and mixed steps, a step after an idle wait (no wall, its span)."""
    root.mkdir(parents=True)
    for rank in range(2):
        header = {"type": "kvwarm_trace", "schema_version": 1, "rank": rank, "dp_size": 2}
        header.update(started_at="2026-12-04T10:00:00.250000Z", timing={"basis": "update_to_update"})
        lines = [header]
        for n in range(30):
            b, p = (n % 4) + 1, 200 * (n % 3 == 0)
            wall = None if n in (0, 12) else 0.004 + 0.0002 * b + 1e-6 * 100 * b * n + 2e-6 * p
            lines.append(
                {
                    "step": n,
                    "at": 0.01 * n + 0.001 * rank,
                    "wall": wall,
                    "span": 0.005,
                    "decode": {"requests": b, "kv_tokens": 100 * b * n, "kv_var": 25.0 * n},
                    "prefill": {"requests": int(p > 0), "new_tokens": p, "prefix_tokens": 0, "prompt_var": 0.0},
                    "queued": {"requests": 2, "tokens": 900, "var": 40000.0, "resuming": 0},
                }
            )
        (root / f"trace-dp{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


def check_capture(dynamo, path: Path) -> list:
    """Every line of an FPM capture: {received_at_ns, metrics}, the metrics decoded strictly as
    the planner's ForwardPassMetrics holding the line's values."""
    fpms = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert sorted(record) == ["metrics", "received_at_ns"] and isinstance(record["received_at_ns"], int)
        fpm = dynamo.msgspec.json.decode(json.dumps(record["metrics"]).encode(), type=dynamo.FPM, strict=True)
        assert dynamo.msgspec.to_builtins(fpm) == record["metrics"]
        fpms.append(fpm)
    return fpms


def feed_models(dynamo, fpms: list) -> dict:
    """The planner's models learning from the steps as from live FPMs (add_observation): decode
    steps the decode model, prefill steps the prefill model, every step the aggregated one."""
    from dynamo.planner.core.perf_model.agg import AggRegressionModel

    models = {
        "decode": dynamo.Decode(256, 5, 16),
        "prefill": dynamo.Prefill(256, 5, 16),
        "agg": AggRegressionModel(256),
    }
    for fpm in fpms:
        s = fpm.scheduled_requests
        if s.num_decode_requests and not s.num_prefill_requests:
            models["decode"].add_observation(fpm)
        if s.num_prefill_requests and not s.num_decode_requests:
            models["prefill"].add_observation(fpm)
        models["agg"].add_observation(fpm)
    return {name: model.num_observations for name, model in models.items()}


def test_a_traces_fpms_decode_as_the_planners_struct_and_its_models_learn_them(dynamo, tmp_path):
    from vllm.kvwarm.record.export.fpm import write_fpm

    path, left_out, _ = write_fpm(made_trace_lines(tmp_path / "trace"))
    fpms = check_capture(dynamo, path)
    assert left_out == 0 and len(fpms) == 60
    assert [(f.dp_rank, f.counter_id) for f in fpms[:4]] == [(0, 1), (1, 1), (0, 2), (1, 2)]
    assert all(f.wall_time == 0.005 for f in fpms if f.counter_id in (1, 13))  # the span after an idle wait
    seen = feed_models(dynamo, fpms)
    assert seen == {"decode": 40, "prefill": 0, "agg": 60}
    decode = dynamo.Decode(256, 5, 16)
    decode.load_benchmark_fpms([f for f in fpms if not f.scheduled_requests.num_prefill_requests])
    assert decode._ensure_fitted()


def test_a_real_served_traces_capture_is_read_by_the_planner(dynamo):
    folder = os.environ.get(EXPORTS_ENV)
    if not folder:
        pytest.skip(f"{EXPORTS_ENV} is not set: `nox -s consumers-S` serves the traced engine (-m export) first")
    skip_where_not_made(Path(folder))
    served = Path(folder) / "served"
    assert served.is_dir(), f"{served}: the served trace's export is missing; see tests/engine/test_export_sweeps.py"
    fpms = check_capture(dynamo, served / "trace" / "fpm.jsonl")
    steps = [json.loads(x) for x in (served / "trace" / "trace-dp0.jsonl").read_text().splitlines()[1:]]
    assert [f.counter_id for f in fpms] == [s["step"] + 1 for s in steps]
    seen = feed_models(dynamo, fpms)
    assert seen["agg"] == len(steps) and seen["decode"] > 0 and seen["prefill"] > 0
