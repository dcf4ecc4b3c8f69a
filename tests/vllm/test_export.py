"""`python -m vllm.kvwarm export`: a sweep's artifacts, written as the sweep writes them (its
ArtifactWriter and the meta it fills; rows with their graph record, phases, sample kind and
split), as Dynamo's self-benchmark artifact and as the profiler's tables: naming, values,
data-parallel ranks that disagree, old artifacts, bad input, and the sweep's own hook at
DYN_FPM_BENCHMARK_OUTPUT_PATH. Dynamo's own readers run on these files in
tests/engine/test_export_consumers.py (the consumers venv)."""

from __future__ import annotations

import json
import statistics
from unittest import mock

import numpy as np
import pytest
from vllm.kvwarm.__main__ import main
from vllm.kvwarm.record import vocabulary as v
from vllm.kvwarm.record.artifact import PointRow, write_artifact
from vllm.kvwarm.record.combined import write_combined
from vllm.kvwarm.record.export import write as export
from vllm.kvwarm.record.export.input import ExportError, load_sweep
from vllm.kvwarm.record.shape import GraphConfig, balanced
from vllm.kvwarm.sweep.gc_hold import GcHold
from vllm.kvwarm.sweep.provenance import RankLayout
from vllm.kvwarm.sweep.writer import ArtifactWriter

RESOLVED = {
    "block_sizes": {"0:FullAttentionSpec": 16},
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "max_model_len": 1024,
    "dtype": "bfloat16",
    "kv_cache_dtype": "auto",
    "enable_prefix_caching": True,
    "enforce_eager": True,
    "cudagraph_mode": "CUDAGraphMode.NONE",
    "cudagraph_capture_sizes": [],
    "num_gpu_blocks": 500,
    "kv_cache_tokens": 8000,
}


# What a sweep on an eager engine records per row: the graph its shape expects (none) and the
# median of each phase over its samples (decode: whole windows; prefill: its shots' windows).
EAGER = {
    "expected_cudagraph_mode": "NONE",
    "expected_capture_size": None,
    "padding_tokens": 0,
    "reasons": [v.CUDAGRAPH_DISABLED],
    "observed_cudagraph_mode": None,
    "observed_size": None,
}


EAGER_ENGINE = GraphConfig.of("NONE", "NONE", "NONE", [], 8, 512)  # sweep.graphs' record of an eager engine


def _phases(median: float, forward: float) -> dict:
    return {"schedule": 0.0005, "forward": forward, "update": 0.0003, "sweep": 0.0001, "other": median * 0.01}


def decode_row(k: int, b: int, times=(0.010, 0.012, 0.011), stamps=None, graph=EAGER) -> PointRow:
    stamps = [v.STAMP_REAL_KV] if stamps is None else stamps
    median = statistics.median_high(times)
    return PointRow(
        k,
        b,
        v.REAL_KV,
        list(stamps),
        list(times),
        median,
        phases=_phases(median, median * 0.9),
        graph=None if graph is None else dict(graph),
        sample_kind=v.STEP,
    )


def prefill_row(n: int, p: int, b: int, times=(0.02, 0.03, 0.025), graph=EAGER) -> PointRow:
    """A prefill row as the sweep writes it: its samples are its shots' forward phases, and
    its split the requests' prefixes (whole 16-token blocks) and new tokens."""
    regime = v.REAL_PREFIX if p else v.NOT_APPLICABLE
    median = statistics.median_high(times)
    blocks = [p // 16 // b + (i < p // 16 % b) for i in range(b)]
    return PointRow(
        p,
        b,
        regime,
        [v.STAMP_PREFILL_REAL_SEED] if p else [],
        list(times),
        median,
        point_type=v.PREFILL,
        total_prefill_tokens=n,
        phases=_phases(median * 1.2, median),
        graph=None if graph is None else dict(graph),
        sample_kind=v.SHOT_FORWARD,
        split={"prefix_tokens": [16 * x for x in blocks], "new_tokens": balanced(n, b)},
    )


def write_rank(
    folder,
    rows,
    *,
    rank=0,
    size=1,
    status=v.COMPLETE,
    resolved=RESOLVED,
    times=("2026-12-02T09:00:00Z", "2026-12-02T09:00:04Z"),
    error=None,
    graphs=EAGER_ENGINE,
    exchange=None,
):
    """One rank's artifact as the sweep writes it: through its ArtifactWriter, whose meta
    the sweep fills (noisy_spread, the collector's record, the engine's graphs; graphs=None:
    an artifact from before the sweep recorded them). The plot is not drawn (the export
    never reads it)."""
    layout = RankLayout(size, rank, 1, 1, False)
    out = folder.parent if size > 1 else folder
    writer = ArtifactWriter(str(out), {"points": "p.json", "model": "/m"}, str(folder) if size > 1 else None, layout)
    writer.meta.enabled, writer.meta.warm_eligible = True, True
    writer.meta.giant_kv_repeats, writer.meta.giant_kv_threshold = 3, 1_000_000
    writer.meta.batch_semantics, writer.meta.global_batch_factor = "per_rank", size
    writer.meta.cudagraph = graphs.record() if graphs is not None else None
    writer.meta.gc = GcHold().record()
    writer.meta.exchange = exchange
    writer.meta.reset_prefix_cache = status == v.COMPLETE
    writer.run = {"started_at": times[0], "finished_at": None, "engine_args": {"given": [], "resolved": resolved}}
    writer.rows = list(rows)
    with (
        mock.patch("vllm.kvwarm.sweep.writer.utc_now", return_value=times[1]),
        mock.patch("vllm.kvwarm.record.plot.write_plot"),
    ):
        writer.write(status, error)
    return json.loads(writer.artifact_path.read_text())


def dp_sweep(root, rows_per_rank, **kwargs):
    for rank, rows in enumerate(rows_per_rank):
        write_rank(root / f"dp{rank}", rows, rank=rank, size=len(rows_per_rank), **kwargs)
    write_combined(root, len(rows_per_rank))
    return root


def dynamo_files(root, out, kind=None):
    return [json.loads(p.read_text()) for p in export.write_dynamo(load_sweep(root), out, kind)]


def test_one_file_per_rank_and_kind_named_as_dynamo_names_them(tmp_path):
    assert export.dynamo_paths(tmp_path / "b.json", ["decode"], 3) == {
        ("decode", 0): tmp_path / "b.json",
        ("decode", 1): tmp_path / "b_dp1.json",
        ("decode", 2): tmp_path / "b_dp2.json",
    }
    both = export.dynamo_paths(tmp_path / "b.json", ["decode", "prefill"], 2)
    assert {(kind, rank): p.name for (kind, rank), p in both.items()} == {
        ("agg", 0): "b.json",  # both kinds at the path, as Dynamo's agg mode
        ("agg", 1): "b_dp1.json",
        ("decode", 0): "b_decode.json",
        ("decode", 1): "b_decode_dp1.json",
        ("prefill", 0): "b_prefill.json",
        ("prefill", 1): "b_prefill_dp1.json",
    }


def test_the_command_writes_each_kind_with_its_mode_and_the_profilers_tables(tmp_path, capsys):
    out = tmp_path / "sweep"
    write_rank(out, [decode_row(1000, 4), decode_row(300, 2), prefill_row(256, 0, 1), prefill_row(128, 512, 2)])
    assert main(["export", str(out), "--to", "dynamo"]) == 0
    folder = out / "dynamo"
    names = ["benchmark.json", "benchmark_decode.json", "benchmark_prefill.json"]
    assert sorted(p.name for p in folder.iterdir()) == names
    agg, decode, prefill = (json.loads((folder / name).read_text()) for name in names)
    assert (decode["config"]["mode"], prefill["config"]["mode"], agg["config"]["mode"]) == ("decode", "prefill", "agg")
    # agg: the prefill points, then the decode points, numbered on, as Dynamo's agg mode runs them
    assert [(r["point"]["point_type"], r["point"]["benchmark_id"]) for r in agg["results"]] == [
        ("prefill", 1),
        ("prefill", 2),
        ("decode", 3),
        ("decode", 4),
    ]
    assert [r["fpms"] for r in agg["results"][2:]] == [
        [{**f, "counter_id": f["counter_id"] + 2} for f in r["fpms"]] for r in decode["results"]
    ]
    assert agg["coverage"] == {"expected_points": 4, "completed_points": 4, "skipped_points": 0}
    assert (agg["valid"], agg["missing_phases"], "kvwarm" in agg) == (True, [], True)
    assert [r["point"]["total_kv_read_tokens"] for r in decode["results"]] == [1000, 300]
    assert "kvwarm" in decode and "kvwarm" not in prefill  # Dynamo's warm-up block: decode runs only
    assert decode["run_id"] == prefill["run_id"] and decode["grid_digest"] != prefill["grid_digest"]
    assert main(["export", str(out), "--to", "dynamo", "--kind", "prefill", "--out", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["results"] == prefill["results"]
    assert main(["export", str(out), "--to", "profiler"]) == 0
    names = sorted(p.relative_to(out / "profiler").as_posix() for p in (out / "profiler").rglob("*") if p.is_file())
    assert names == [
        "decode_raw_data.json",
        "prefill_raw_data.json",
        "selected_decode_interpolation/raw_data.npz",
        "selected_prefill_interpolation/raw_data.npz",
    ]
    assert "wrote" in capsys.readouterr().out


def test_a_row_becomes_a_point_an_fpm_and_its_own_block(tmp_path):
    root = tmp_path / "s"
    write_rank(
        root,
        [decode_row(10, 4, (0.004, 0.006, 0.005, 0.007), stamps=[v.STAMP_REAL_KV, v.NOISY]), prefill_row(7, 32, 2)],
    )
    (decode,) = dynamo_files(root, tmp_path / "d.json", "decode")
    result = decode["results"][0]
    assert result["point"]["sample_reasons"] == ["explicit", v.CUDAGRAPH_DISABLED, v.STAMP_REAL_KV, v.NOISY]
    assert result["point"]["expected_cudagraph_mode"] == "NONE" and result["point"]["benchmark_id"] == 1
    fpm = result["fpms"][0]
    assert fpm["wall_time"] == 0.006 and fpm["kvwarm_giant_median_of"] == 4 and fpm["counter_id"] == 1
    # contexts 3, 3, 2, 2: the population variance of the balanced split
    assert fpm["scheduled_requests"]["num_decode_requests"] == 4
    assert fpm["scheduled_requests"]["var_decode_kv_tokens"] == 1 / 4
    assert result["kvwarm_sweep"]["steady_seconds"] == [0.004, 0.006, 0.005, 0.007]
    assert result["kvwarm_sweep"]["median_of"] == 4
    # what the sweep records beside the samples travels with them: the phases, the graph
    # record (the row's own), and the writer's meta in the top block
    assert result["kvwarm_sweep"]["phases"]["forward"] == pytest.approx(0.006 * 0.9)
    assert result["kvwarm_sweep"]["graph"]["reasons"] == [v.CUDAGRAPH_DISABLED]
    top = decode["kvwarm_sweep"]["kvwarm"]
    assert top["noisy_spread"] == 0.5 and top["gc"]["policy"] == "held" and top["cudagraph"]["mode"] == "NONE"
    (prefill,) = dynamo_files(root, tmp_path / "p.json", "prefill")
    scheduled = prefill["results"][0]["fpms"][0]["scheduled_requests"]
    assert (scheduled["num_prefill_requests"], scheduled["sum_prefill_tokens"], scheduled["sum_prefill_kv_tokens"]) == (
        2,
        7,
        32,
    )
    assert scheduled["var_prefill_length"] == 1 / 4  # lengths 4 + 16, 3 + 16
    assert "kvwarm_giant_median_of" not in prefill["results"][0]["fpms"][0]


def test_every_rank_shares_the_points_and_groups_and_a_group_takes_its_slowest_rank(tmp_path):
    root = dp_sweep(
        tmp_path / "s",
        [
            [
                decode_row(400, 2, (0.010, 0.011, 0.012)),
                decode_row(100, 1, (0.005,) * 3, stamps=[v.STAMP_REAL_KV, v.NOISY]),
            ],
            [decode_row(400, 2, (0.013, 0.014, 0.015)), decode_row(100, 1, (0.004,) * 3)],
        ],
    )
    files = dynamo_files(root, tmp_path / "b.json")
    assert [f["dp"] for f in files] == [{"rank": 0, "size": 2}, {"rank": 1, "size": 2}]
    assert files[0]["iteration_groups"] == files[1]["iteration_groups"]
    assert [r["point"] for r in files[0]["results"]] == [r["point"] for r in files[1]["results"]]
    groups = files[0]["iteration_groups"]
    assert [g["wall_time"] for g in groups] == [0.014, 0.005]
    assert files[1]["timing"]["measured_iteration_seconds"] == 0.014 + 0.005
    # one rank's stamp is on the shared point; each rank's own stamps stay in its block
    assert v.NOISY in files[1]["results"][1]["point"]["sample_reasons"]
    assert files[1]["results"][1]["kvwarm_sweep"]["sample_reasons"] == [v.STAMP_REAL_KV]
    assert [f["results"][0]["fpms"][0]["dp_rank"] for f in files] == [0, 1]
    # a record older than its record of the exchange: no port, and said so
    assert files[0]["synchronization"] == {"enabled": True, "coordinator_rank": 0, "port": None}
    assert files[0]["kvwarm_sweep"]["unfilled"]["synchronization.port"].startswith("not in the sweep's record")


@pytest.mark.parametrize(
    "exchange, port",
    [
        (
            {
                "exchange": "store",
                "address": "10.0.0.1",
                "port": 29510,
                "port_origin": "vLLM's DP master port 29500 + 10",
            },
            29510,
        ),
        ({"exchange": "files", "address": "/out/.kvwarm-sync/x", "port": None, "port_origin": None}, None),
    ],
)
def test_the_export_says_which_exchange_and_port_the_ranks_met_through(tmp_path, exchange, port):
    root = dp_sweep(tmp_path / "s", [[decode_row(100, 1)], [decode_row(100, 1)]], exchange=exchange)
    for f in dynamo_files(root, tmp_path / "b.json"):
        assert f["synchronization"] == {"enabled": True, "coordinator_rank": 0, "port": port}
        assert f["kvwarm_sweep"]["synchronization"] == exchange
        unfilled = f["kvwarm_sweep"]["unfilled"]
        if port is None:
            assert (
                unfilled["synchronization.port"] == "the ranks met through files in the output folder, not a TCP port"
            )
        else:
            assert "synchronization.port" not in unfilled


def test_a_point_skipped_on_one_rank_is_skipped_on_every_rank_and_the_files_are_not_valid(tmp_path):
    skipped = PointRow(600, 3, v.skip_regime(v.BATCH_SIZE_MISMATCH), detail="a timed step ran 2 requests")
    root = dp_sweep(tmp_path / "s", [[decode_row(600, 3), decode_row(200, 2)], [skipped, decode_row(200, 2)]])
    for f in dynamo_files(root, tmp_path / "b.json"):
        assert [r["point"]["total_kv_read_tokens"] for r in f["results"]] == [200]
        assert f["coverage"] == {"expected_points": 2, "completed_points": 1, "skipped_points": 1}
        assert (f["status"], f["valid"], f["usable"]) == ("complete", False, False)
        entry = f["skipped_points"][0]
        assert entry["kv_seed_regime"] == "unstamped"
        assert entry["kvwarm_sweep"] == {
            "kv_seed_regime": "skip:measured_batch_size_mismatch",
            "reason": skipped.detail,
        }


def test_a_failed_sweep_exports_as_failed_with_its_error_and_the_points_it_reached(tmp_path):
    root = dp_sweep(
        tmp_path / "s",
        [[decode_row(600, 3), decode_row(200, 2)], [decode_row(600, 3)]],
        status=v.FAILED,
        error="RankFailed: rank 1 stopped",
    )
    files = dynamo_files(root, tmp_path / "b.json")
    for f in files:
        assert (f["status"], f["valid"], f["usable"], f["error"]) == (
            "failed",
            False,
            False,
            "RankFailed: rank 1 stopped",
        )
        assert f["coverage"] == {"expected_points": 2, "completed_points": 1, "skipped_points": 0}


def test_elapsed_is_never_below_the_timed_samples_of_whole_second_times(tmp_path):
    root = tmp_path / "s"
    write_rank(root, [decode_row(100, 1, (0.4, 0.5, 0.6))], times=("2026-12-02T09:00:00Z", "2026-12-02T09:00:00Z"))
    (f,) = dynamo_files(root, tmp_path / "b.json")
    assert f["timing"]["benchmark_elapsed_seconds"] == pytest.approx(1.5)
    assert f["timing"]["measured_iteration_seconds"] == 0.5 and f["timing_valid"] is True
    write_rank(root, [decode_row(100, 1)], times=("2026-12-02T09:00:00.500Z", "2026-12-02T09:00:08.000Z"))
    (f,) = dynamo_files(root, tmp_path / "b.json")
    assert f["timing"]["benchmark_elapsed_seconds"] == 7.5
    # timed steps that cannot fit in the record's span, even to its one-second resolution
    write_rank(root, [decode_row(100, 1, (1.4, 1.5, 1.6))], times=("2026-12-02T09:00:00Z", "2026-12-02T09:00:00Z"))
    (f,) = dynamo_files(root, tmp_path / "b.json")
    assert (f["timing_valid"], f["valid"], f["usable"]) == (False, False, False)


def test_the_graph_a_point_runs_in_follows_the_engines_capture_sizes(tmp_path):
    graphs = {
        **RESOLVED,
        "enforce_eager": False,
        "cudagraph_mode": "CUDAGraphMode.FULL_AND_PIECEWISE",
        "cudagraph_capture_sizes": [1, 2, 4, 8, 16],
    }
    root = tmp_path / "s"  # an artifact from before rows and the sweep recorded graphs
    rows = [decode_row(300, 3), decode_row(800, 8), decode_row(40, 4), prefill_row(600, 0, 1)]
    for row in rows:
        row.graph = None
    write_rank(root, rows, resolved=graphs, graphs=None)
    files = {f["config"]["mode"]: f for f in dynamo_files(root, tmp_path / "b.json")}
    points = [r["point"] for r in files["decode"]["results"]]
    assert [(p["expected_cudagraph_mode"], p["expected_capture_size"], p["padding_tokens"]) for p in points] == [
        ("FULL", 4, 1),
        ("FULL", 8, 0),
        ("FULL", 4, 0),
    ]
    assert [p["sample_reasons"][1:-1] for p in points] == [[v.POST_CAPTURE], [v.CAPTURE, v.ENGINE_LIMIT], [v.CAPTURE]]
    (prefill,) = [r["point"] for r in files["prefill"]["results"]]
    assert (prefill["expected_cudagraph_mode"], prefill["sample_reasons"][1]) == ("NONE", v.EAGER_TAIL)
    cudagraph = files["decode"]["cudagraph"]
    assert (cudagraph["mode"], cudagraph["prefill_mode"], cudagraph["decode_mode"]) == (
        "FULL_AND_PIECEWISE",
        "PIECEWISE",
        "FULL",
    )
    assert cudagraph["decode_capture_sizes"] == [1, 2, 4, 8] and cudagraph["max_capture_size"] == 16
    row = decode_row(300, 3)
    row.graph = {
        "expected_cudagraph_mode": "PIECEWISE",
        "expected_capture_size": 4,
        "padding_tokens": 1,
        "reasons": [v.POST_CAPTURE],
    }
    write_rank(root, [row], resolved=graphs)
    (f,) = dynamo_files(root, tmp_path / "b.json")
    assert f["results"][0]["point"]["expected_cudagraph_mode"] == "PIECEWISE"  # the row's own record wins


def test_the_engines_graphs_are_what_the_sweep_recorded_and_a_skipped_point_gets_the_sweeps_graph(tmp_path):
    """The sweep records vLLM's own decode_mode()/mixed_mode() answers (kvwarm.cudagraph): the
    export takes them over its reading of the resolved mode's name, and a point without a
    graph record of its own (a skipped one) is given the graph by the sweep's own rule."""
    graphs = {
        **RESOLVED,
        "enforce_eager": False,
        "cudagraph_mode": "CUDAGraphMode.FULL_AND_PIECEWISE",
        "cudagraph_capture_sizes": [1, 2, 4, 8, 16],
    }
    recorded = {
        "mode": "FULL_AND_PIECEWISE",
        "decode_mode": "FULL",
        "prefill_mode": "NONE",  # not what the mode's name reads as: the record wins
        "capture_sizes": [1, 2, 4, 8, 16],
        "decode_capture_sizes": [1, 2, 4],
        "prefill_capture_sizes": [],
    }
    root = tmp_path / "s"
    skipped = PointRow(600, 3, v.skip_regime(v.BATCH_SIZE_MISMATCH), detail="a timed step ran 2 requests")
    artifact = write_rank(root, [decode_row(300, 2), skipped, prefill_row(8, 0, 1)], resolved=graphs)
    artifact["kvwarm"]["cudagraph"] = recorded
    write_artifact(root, artifact)
    files = {f["config"]["mode"]: f for f in dynamo_files(root, tmp_path / "b.json")}
    cudagraph = files["decode"]["cudagraph"]
    assert (cudagraph["mode"], cudagraph["prefill_mode"], cudagraph["decode_mode"]) == (
        "FULL_AND_PIECEWISE",
        "NONE",
        "FULL",
    )
    assert (cudagraph["decode_capture_sizes"], cudagraph["prefill_capture_sizes"]) == ([1, 2, 4], [])
    assert files["decode"]["engine"]["graph"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    (entry,) = files["decode"]["skipped_points"]
    point = entry["point"]  # B = 3 rides the decode capture size 4, padded by 1
    assert (point["expected_cudagraph_mode"], point["expected_capture_size"], point["padding_tokens"]) == ("FULL", 4, 1)
    (prefill,) = [r["point"] for r in files["prefill"]["results"]]  # no prefill graphs: eager, null padding
    assert (prefill["expected_cudagraph_mode"], prefill["expected_capture_size"], prefill["padding_tokens"]) == (
        "NONE",
        None,
        None,
    )
    assert prefill["sample_reasons"][1] == v.CUDAGRAPH_DISABLED


def test_rows_written_before_their_sample_kind_still_export_and_report(tmp_path):
    from vllm.kvwarm.record.runs import load_run

    root = tmp_path / "s"
    artifact = write_rank(root, [decode_row(300, 2), prefill_row(64, 0, 1)])
    assert [r["sample_kind"] for r in artifact["results"]] == [v.STEP, v.SHOT_FORWARD]
    for row in artifact["results"]:
        del row["sample_kind"]
    (root / "sweep.json").write_text(json.dumps(artifact))
    files = {f["config"]["mode"]: f for f in dynamo_files(root, tmp_path / "b.json")}
    assert [r["kvwarm_sweep"]["steady_seconds"] for r in files["decode"]["results"]] == [[0.010, 0.012, 0.011]]
    assert [row.kind for row in load_run(str(root)).rows] == ["decode", "prefill"]


def test_the_profiler_tables_hold_the_rows_in_the_profilers_units(tmp_path):
    root = dp_sweep(
        tmp_path / "s",
        [
            [
                decode_row(1000, 4, (0.010,) * 3),
                prefill_row(256, 0, 1, (0.020,) * 3),
                prefill_row(256, 512, 1),
                prefill_row(256, 0, 2),
            ],
            [
                decode_row(1000, 4, (0.012,) * 3),
                prefill_row(256, 0, 1, (0.025,) * 3),
                prefill_row(256, 512, 1),
                prefill_row(256, 0, 2),
            ],
        ],
    )
    export.write_profiler(load_sweep(root), tmp_path / "p")
    with np.load(tmp_path / "p" / "selected_decode_interpolation" / "raw_data.npz") as d:
        assert d["x_kv_usage"].tolist() == [1000 / 8000] and d["y_context_length"].tolist() == [250.0]
        assert d["z_itl"].tolist() == pytest.approx([12.0]) and d["max_kv_tokens"].tolist() == [8000]
        assert d["z_thpt_per_gpu"].tolist() == pytest.approx([4 / 0.012])
    with np.load(tmp_path / "p" / "selected_prefill_interpolation" / "raw_data.npz") as d:  # B = 1, P = 0 only
        assert d["prefill_isl"].tolist() == [256.0] and d["prefill_ttft"].tolist() == pytest.approx([25.0])
        assert d["prefill_thpt_per_gpu"].tolist() == pytest.approx([256 / 0.025])
    fallback = json.loads((tmp_path / "p" / "decode_raw_data.json").read_text())
    assert fallback["max_kv_tokens"] == 8000 and fallback["z_itl"] == pytest.approx([12.0])


def test_the_profiler_export_refuses_what_it_cannot_table(tmp_path, capsys):
    root = tmp_path / "old"
    write_rank(root, [decode_row(100, 1)], resolved={k: val for k, val in RESOLVED.items() if k != "kv_cache_tokens"})
    assert main(["export", str(root), "--to", "profiler"]) == 2
    assert "--max-kv-tokens" in capsys.readouterr().err
    assert main(["export", str(root), "--to", "profiler", "--max-kv-tokens", "4000"]) == 0
    write_rank(root, [decode_row(100, 1)], status=v.FAILED, error="boom")
    assert main(["export", str(root), "--to", "profiler"]) == 2
    assert "did not complete" in capsys.readouterr().err
    write_rank(root, [prefill_row(64, 128, 1)])
    assert main(["export", str(root), "--to", "profiler"]) == 2
    assert "B = 1, P = 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda d: None, "no sweep.json here"),
        (lambda d: (d / "sweep.json").write_text("{"), "not valid JSON"),
        (lambda d: (d / "sweep.json").write_text('{"results": [], "schema_version": 9}'), "schema_version 9"),
        (
            lambda d: (d / "sweep.json").write_text('{"results": [], "schema_version": 2, "artifact_type": "merged"}'),
            "cannot be exported again",
        ),
        (lambda d: write_rank(d, [decode_row(100, 1)], status=v.RUNNING), "status 'running'"),
        (lambda d: write_rank(d, [decode_row(100, 1)], rank=1, size=2), "pass the sweep's --out folder"),
        # a decode-only sweep has no prefill file to write (it wrote an empty "complete" one)
        (lambda d: write_rank(d, [decode_row(100, 1)]), "the sweep has no prefill points (it has decode points)"),
    ],
)
def test_bad_input_is_named_with_the_fix(tmp_path, capsys, make, says):
    folder = tmp_path / "sweep"
    folder.mkdir()
    make(folder)
    assert main(["export", str(folder), "--to", "dynamo", "--kind", "prefill"]) == 2
    err = capsys.readouterr().err
    assert says in err and str(folder) in err


def test_a_schema_2_artifact_exports_as_decode_points(tmp_path):
    artifact = write_rank(tmp_path / "s", [decode_row(100, 1)])
    artifact["schema_version"], artifact["artifact_type"] = 2, "rank"
    del artifact["results"][0]["point"]["point_type"]
    del artifact["config"]["engine_args"]
    (tmp_path / "s" / "sweep.json").write_text(json.dumps(artifact))
    (f,) = dynamo_files(tmp_path / "s", tmp_path / "b.json")
    assert f["config"]["mode"] == "decode" and f["results"][0]["point"]["point_type"] == "decode"
    assert f["limits"]["num_gpu_blocks"] is None and "limits.num_gpu_blocks" in f["kvwarm_sweep"]["unfilled"]


def test_the_sweeps_hook_writes_every_ranks_file_from_their_final_records(tmp_path):
    out = tmp_path / "dynamo" / "benchmark.json"
    environ = {export.OUTPUT_ENV: str(out)}
    write_rank(tmp_path / "s" / "dp0", [decode_row(100, 1)], size=2)
    write_rank(tmp_path / "s" / "dp1", [decode_row(100, 1)], rank=1, size=2, status=v.RUNNING)
    ranks = [json.loads((tmp_path / "s" / f"dp{r}" / "sweep.json").read_text()) for r in range(2)]
    assert export.write_final(tmp_path / "s", ranks, {}) == []  # not asked
    with pytest.raises(ExportError, match=r"rank\(s\) \[1\] never finished their record"):
        export.write_final(tmp_path / "s", ranks, environ)  # rank 1 given up on while running
    with pytest.raises(ExportError, match=r"rank\(s\) \[1\] never finished"):
        export.write_final(tmp_path / "s", [ranks[0], None], environ)  # nor one that sent nothing
    write_rank(tmp_path / "s" / "dp1", [decode_row(100, 1)], rank=1, size=2)
    ranks[1] = json.loads((tmp_path / "s" / "dp1" / "sweep.json").read_text())
    assert export.write_final(tmp_path / "s", ranks, environ) == [out, out.with_name("benchmark_dp1.json")]
    export.remove_stale(environ, 1)  # a new run's rank 1, as Dynamo does at its start
    assert out.is_file() and not out.with_name("benchmark_dp1.json").exists()


def test_prefill_rows_with_a_prefix_can_be_left_out_for_a_fit_on_new_tokens_alone(tmp_path):
    """The planner fits prefill time on sum_prefill_tokens alone; a grid's P > 0 rows would
    read as slow prompts to it. --no-prefix-rows leaves them out (measured or skipped), and the
    file's coverage and validity count only what it holds."""
    root = tmp_path / "s"
    regime = v.skip_regime(v.PREFILL_INJECTION_FAILED)
    skipped = PointRow(512, 1, regime, detail="no room", point_type=v.PREFILL, total_prefill_tokens=64)
    write_rank(root, [prefill_row(256, 0, 1), prefill_row(256, 512, 1), prefill_row(64, 0, 4), skipped])
    out = tmp_path / "p.json"
    args = ["export", str(root), "--to", "dynamo", "--kind", "prefill", "--out", str(out)]
    assert main([*args, "--no-prefix-rows"]) == 0
    exported = json.loads(out.read_text())
    points = [(r["point"]["total_prefill_tokens"], r["point"]["total_kv_read_tokens"]) for r in exported["results"]]
    assert points == [(256, 0), (64, 0)] and exported["skipped_points"] == []
    assert exported["coverage"] == {"expected_points": 2, "completed_points": 2, "skipped_points": 0}
    assert exported["valid"] is True
    assert exported["kvwarm_sweep"]["left_out"] == "prefill points with a prefix (P > 0)"
    assert main(args) == 0
    everything = json.loads(out.read_text())
    assert len(everything["results"]) == 3 and everything["valid"] is False  # the skipped point counts
    assert everything["kvwarm_sweep"]["left_out"] is None
