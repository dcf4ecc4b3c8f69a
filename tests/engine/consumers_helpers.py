"""What the tests of Dynamo's consumers share (tests/engine/test_export_consumers*.py, run in
the consumers venv: no vLLM, the overlay's record room on the path): Dynamo's own code,
sweeps made with the record's builder and exported, and the checks made and real sweeps
share. Nothing here imports Dynamo or the overlay at import time: the engine venv collects
these tests too (and deselects them)."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import shutil
import sys
import types
from pathlib import Path

import pytest

EXPORTS_ENV = "KVWARM_EXPORTS"


def skip_where_not_made(folder: Path) -> None:
    """The real sweeps skipped on this host (-m export says why in the folder): so do these."""
    from kvwarm_testing.engine import EXPORTS_SKIPPED

    if (folder / EXPORTS_SKIPPED).is_file():
        pytest.skip(f"the real sweeps were not made here: {(folder / EXPORTS_SKIPPED).read_text()}")


# --- Dynamo's code -------------------------------------------------------------------------
def load_dynamo():
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


# --- a served-step trace as Dynamo's forward-pass metrics capture ---------------------------
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
