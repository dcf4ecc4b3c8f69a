"""The generated grid and the graph every row expects: axes laid around the capture sizes,
C / C + 1 pairs never broken by thinning, powers of two without graphs, and a grid sweep
configured through additional_config on a real Scheduler."""

from __future__ import annotations

import json

from kvwarm_testing.real_kv import in_use, make_scheduler, step_scheduler
from vllm.kvwarm.record.shape import GraphConfig, expected_graph
from vllm.kvwarm.scheduler import KvWarmScheduler
from vllm.kvwarm.sweep.graphs import graph_config
from vllm.kvwarm.sweep.grid import GridLimits, axis, decode_grid, prefill_grid, thin
from vllm.kvwarm.sweep.points import DecodePoint, PrefillPoint, parse_points

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512)
GRAPHS = GraphConfig(
    "FULL_AND_PIECEWISE",
    "FULL",
    "PIECEWISE",
    SIZES,
    tuple(s for s in SIZES if s <= 128),
    SIZES,
    max_num_seqs=128,
    max_num_batched_tokens=2048,
)
LIMITS = GridLimits(
    max_model_len=4096, steady_steps=3, kv_cache_tokens=400_000, num_blocks=25_000, block_size=16, prefix_unit=16
)


def test_the_batch_axis_holds_every_capture_size_its_successor_an_eager_tail_and_the_limit():
    values, pairs = axis((1, 2, 4, 8, 16), limit=100)
    assert values == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 64, 100]
    assert pairs == {(1, 2), (2, 3), (4, 5), (8, 9), (16, 17)}
    assert axis((), limit=100)[0] == [1, 2, 4, 8, 16, 32, 64, 100]  # no graphs: powers of two


def test_thinning_keeps_the_ends_and_never_breaks_a_pair():
    values, pairs = axis(SIZES, limit=1000)
    for cap in (4, 6, 9, 12):
        kept = thin(values, pairs, cap)
        assert kept[0] == values[0] and kept[-1] == values[-1] and len(kept) <= cap + 2
        for c, c1 in pairs:
            assert (c in kept) == (c1 in kept), (cap, c)


def test_the_decode_grid_ladders_kv_per_batch_within_max_model_len_and_the_pool():
    points = decode_grid(GRAPHS, LIMITS)
    batches = sorted({p.batch_size for p in points})
    assert batches[0] == 1 and batches[-1] == 128
    for c, c1 in {(c, c + 1) for c in GRAPHS.decode_capture_sizes if c + 1 <= 128}:
        assert (c in batches) == (c1 in batches)
    for point in points:
        assert 2 * point.batch_size <= point.total_kv_read_tokens  # no context clamped
        assert point.tokens_spanned(LIMITS.steady_steps) <= LIMITS.max_model_len - 4
        assert point.total_kv_read_tokens <= 0.8 * LIMITS.kv_cache_tokens
    b8 = sorted(p.total_kv_read_tokens for p in points if p.batch_size == 8)
    assert b8[0] == 16 and b8[-1] == 8 * (4096 - 3 - 1 - 4)  # 2B, ..., the deepest max_model_len allows


def test_the_prefill_grid_spans_the_prefill_capture_sizes_at_small_batches_and_a_few_prefixes():
    points = prefill_grid(GRAPHS, LIMITS)
    assert {p.batch_size for p in points} == {1, 4}
    depths = {p.total_kv_read_tokens // p.batch_size for p in points}
    assert depths == {0, 1024, 2048}
    tokens = sorted({p.total_prefill_tokens for p in points if p.batch_size == 1})
    assert tokens[-1] == 2048 and all(p.tokens_spanned(16) <= 4096 - 4 for p in points)
    assert (512 in tokens) == (513 in tokens)


def test_each_row_expects_the_graph_of_its_shape():
    assert expected_graph(GRAPHS, "decode", 8) == {
        "expected_cudagraph_mode": "FULL",
        "expected_capture_size": 8,
        "padding_tokens": 0,
        "reasons": ["capture"],
        "observed_cudagraph_mode": None,
        "observed_size": None,
    }
    assert expected_graph(GRAPHS, "decode", 9)["expected_capture_size"] == 16
    assert expected_graph(GRAPHS, "decode", 9)["padding_tokens"] == 7
    assert expected_graph(GRAPHS, "decode", 9)["reasons"] == ["post_capture"]
    assert expected_graph(GRAPHS, "decode", 128)["reasons"] == ["capture", "engine_limit"]
    assert expected_graph(GRAPHS, "prefill", 1000) == {
        "expected_cudagraph_mode": "NONE",
        "expected_capture_size": None,
        "padding_tokens": 0,
        "reasons": ["eager_tail"],
        "observed_cudagraph_mode": None,
        "observed_size": None,
    }
    assert expected_graph(GRAPHS, "prefill", 300)["expected_cudagraph_mode"] == "PIECEWISE"
    eager = GraphConfig(capture_sizes=SIZES, max_num_seqs=128, max_num_batched_tokens=2048)
    assert expected_graph(eager, "decode", 8)["reasons"] == ["cudagraph_disabled"]


# caps that keep the sweep short: two decode batches (a pair), two KV rungs, two prefill sizes
CAPS = {"decode_batches": 2, "kv_ladder": 2, "prefill_tokens": 2}


def test_a_grid_sweep_writes_its_points_file_and_every_row_records_its_graph(tmp_path, monkeypatch):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)  # what the engine core does before any request is hashed
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    out = tmp_path / "out"
    scheduler = make_scheduler(
        tmp_path,
        num_blocks=256,
        scheduler_cls=KvWarmScheduler,
        additional_config={"kvwarm_sweep": {"grid": True, "out": str(out)}},
    )
    graphs = graph_config(scheduler.vllm_config)
    sweep = scheduler.kvwarm_sweep
    for _ in range(5000):
        if sweep.done:
            break
        step_scheduler(scheduler)
    artifact = json.loads((out / "sweep.json").read_text())
    assert artifact["status"] == "complete" and not artifact["skipped_points"]
    grid = parse_points(json.loads((out / "grid.json").read_text()), "grid", 1024, 3)
    measured = [
        (
            r["point"]["point_type"],
            r["point"]["total_prefill_tokens"],
            r["point"]["total_kv_read_tokens"],
            r["point"]["batch_size"],
        )
        for r in artifact["results"]
    ]
    assert sorted(measured) == sorted(
        ("prefill", p.total_prefill_tokens, p.total_kv_read_tokens, p.batch_size)
        if isinstance(p, PrefillPoint)
        else ("decode", 0, p.total_kv_read_tokens, p.batch_size)
        for p in grid
    )
    assert any(isinstance(p, DecodePoint) for p in grid) and any(isinstance(p, PrefillPoint) for p in grid)
    assert artifact["kvwarm"]["grid"]["points"] == len(grid) and artifact["kvwarm"]["cudagraph"] == graphs.record()
    for row in artifact["results"]:
        kind, n = row["point"]["point_type"], row["point"]["total_prefill_tokens"] or row["point"]["batch_size"]
        assert row["graph"] == expected_graph(graphs, kind, n)
    assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_a_grid_sweeps_record_names_its_points_file_by_its_path(tmp_path, monkeypatch):
    """config.points is where the generated grid was written, so the export finds the grid's
    kinds from any working directory (before the sweep has rows of them)."""
    from vllm.kvwarm.record.export_input import SweepRecord

    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    out = tmp_path / "out"
    make_scheduler(
        tmp_path,
        num_blocks=256,
        scheduler_cls=KvWarmScheduler,
        additional_config={"kvwarm_sweep": {"grid": CAPS, "out": str(out)}},
    )
    artifact = json.loads((out / "sweep.json").read_text())
    assert artifact["status"] == "running" and not artifact["results"]
    assert artifact["config"]["points"] == str(out / "grid.json") and (out / "grid.json").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert SweepRecord(out, [artifact], [out / "sweep.json"]).kinds() == ["decode", "prefill"]


def test_the_graphs_take_the_prefill_and_decode_sizes_vllm_resolves_apart_where_it_does(tmp_path):
    """On the real compilation config: where vLLM splits the capture sizes (prefill graphs by
    tokens, decode graphs by requests), decode steps pad to the decode request sizes and
    prefill steps to the prefill token sizes, not to the one list of every graph's tokens;
    elsewhere both kinds come from that list."""
    from vllm.config import CUDAGraphMode
    from vllm.kvwarm.record.shape import SPLIT_SIZES

    scheduler = make_scheduler(tmp_path, max_num_seqs=8)
    config = scheduler.vllm_config
    config.model_config.enforce_eager = False
    compilation = config.compilation_config
    compilation.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    compilation.cudagraph_capture_sizes = [1, 2, 3, 4, 8, 16, 48]
    split = all(hasattr(compilation, name) for name in SPLIT_SIZES)
    if split:
        for name, sizes in zip(SPLIT_SIZES, ([16, 48], [1, 3, 6])):
            setattr(compilation, name, sizes)
    graphs = graph_config(config)
    assert graphs.capture_sizes == (1, 2, 3, 4, 8, 16, 48)
    if split:
        assert (graphs.decode_capture_sizes, graphs.prefill_capture_sizes) == ((1, 3, 6), (16, 48))
        assert expected_graph(graphs, "decode", 5)["expected_capture_size"] == 6
        assert expected_graph(graphs, "prefill", 9)["expected_capture_size"] == 16
    else:
        assert graphs.decode_capture_sizes == (1, 2, 3, 4, 8) and graphs.prefill_capture_sizes == (
            1,
            2,
            3,
            4,
            8,
            16,
            48,
        )
        assert expected_graph(graphs, "decode", 5)["expected_capture_size"] == 8
