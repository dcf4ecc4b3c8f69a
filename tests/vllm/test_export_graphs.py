"""`python -m vllm.kvwarm export`: the graph each exported point runs in, from the engine's
capture sizes (an artifact from before the sweep recorded graphs), from the row's own record,
or from vLLM's own answers the sweep recorded (`kvwarm.cudagraph`), a skipped point's too."""

from __future__ import annotations

from export_helpers import RESOLVED, decode_row, dynamo_files, prefill_row, write_rank
from vllm.kvwarm.record import vocabulary as v
from vllm.kvwarm.record.artifact import PointRow, write_artifact


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
