"""`python -m vllm.kvwarm export`: a sweep's artifacts, written as the sweep writes them
(export_helpers.py), as Dynamo's self-benchmark artifact: naming, values, data-parallel ranks
that disagree, old artifacts, bad input, and the sweep's own hook at
DYN_FPM_BENCHMARK_OUTPUT_PATH. The graph each point runs in: test_export_graphs.py; the
profiler's tables: test_export_profiler.py; the ranks of one sweep: test_export_ranks.py.
Dynamo's own readers run on these files in tests/engine/test_export_consumers*.py (the
consumers venv)."""

from __future__ import annotations

import json

import pytest
from export_helpers import decode_row, dp_sweep, dynamo_files, prefill_row, write_rank
from vllm.kvwarm.__main__ import main
from vllm.kvwarm.record import vocabulary as v
from vllm.kvwarm.record.artifact import PointRow
from vllm.kvwarm.record.export import write as export
from vllm.kvwarm.record.export.input import ExportError


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
