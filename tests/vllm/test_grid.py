"""The generated grid and the graph every row expects: axes laid around the capture sizes,
C / C + 1 pairs never broken by thinning, powers of two without graphs, and a grid sweep
configured through additional_config on a real Scheduler (its mixed points: test_grid_mixed)."""

from __future__ import annotations

import itertools
import json

import pytest
from kvwarm_testing.real_kv import in_use, make_scheduler, step_scheduler
from vllm.kvwarm.record.shape import GraphConfig, expected_graph
from vllm.kvwarm.scheduler import KvWarmScheduler
from vllm.kvwarm.sweep import grid
from vllm.kvwarm.sweep.controller import Sweep
from vllm.kvwarm.sweep.graphs import graph_config
from vllm.kvwarm.sweep.grid import GridLimits, axis, decode_grid, prefill_grid, thin
from vllm.kvwarm.sweep.plan import SweepConfig
from vllm.kvwarm.sweep.points import DecodePoint, MixedPoint, PrefillPoint, parse_points

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


def test_the_batch_axis_holds_every_capture_size_its_successor_a_doubling_tail_and_the_limit():
    batches = axis((1, 2, 4, 8, 16), limit=100)
    assert batches.values == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 64, 100]
    assert batches.pairs == {(1, 2), (2, 3), (4, 5), (8, 9), (16, 17)}
    assert batches.fixed == {32, 64, 100}  # the tail and the limit: never thinned away
    assert axis((), limit=100).values == [1, 2, 4, 8, 16, 32, 64, 100]  # no graphs: powers of two


def test_thinning_keeps_the_ends_and_the_fixed_values_never_breaks_a_pair_and_fills_its_cap():
    batches = axis(SIZES, limit=1000)
    for cap in (9, 10, 12):
        kept = thin(batches.values, batches.pairs, cap, batches.fixed)
        assert kept[0] == 1 and batches.fixed <= set(kept) and len(kept) in (cap - 1, cap)
        for c, c1 in batches.pairs:
            assert (c in kept) == (c1 in kept), (cap, c)
    # a cap below what must stay keeps just that: the first unit, the tail and the limit
    assert thin(batches.values, batches.pairs, 4, batches.fixed) == [1, 2, 3, 1000]


def test_a_ladder_without_pairs_gets_its_cap_in_values_spread_on_a_log_scale():
    """The KV ladder's cap of 6 gives 6 values (it gave 3: the cap was halved for pairs the
    ladder does not have). Written from the rule: B = 8, deepest 8 x (4096 - 3 - 1 - 4) =
    32704; rungs 16, 32, ..., 16384, 32704; keep 16 and 32704; then the middle of the widest
    log gap each time: sqrt(16 x 32704) = 723 -> 512; sqrt(512 x 32704) = 4092 -> 4096;
    sqrt(16 x 512) = 90.5, as near 64 as 128 -> the smaller, 64; 64..512 and 512..4096 are
    as wide -> the smaller: sqrt(64 x 512) = 181, as near 128 as 256 -> 128."""
    b8 = sorted(p.total_kv_read_tokens for p in decode_grid(GRAPHS, LIMITS) if p.batch_size == 8)
    assert b8 == [16, 64, 128, 512, 4096, 32704]
    for cap in range(2, 12):  # B = 8 has 12 rungs to thin: every cap below gives exactly that many
        caps = {**grid.CAPS, "kv_ladder": cap}
        assert len([p for p in decode_grid(GRAPHS, LIMITS, caps) if p.batch_size == 8]) == cap


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
    assert tokens[-1] == 2048 and all(p.tokens_spanned(16) <= 4096 for p in points)
    # at half of max_model_len a request's prompt holds what is left: 4096 - 2048 - 1 new tokens
    assert max(p.total_prefill_tokens for p in points if p.batch_size == 1 and p.total_kv_read_tokens == 2048) == 2047
    assert (512 in tokens) == (513 in tokens)


# vLLM's default capture sizes (its compilation config fills these when none are given)
DEFAULT_SIZES = [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)]


def _grid_sweep(tmp_path, monkeypatch, grid, **scheduler_args):
    """A real Scheduler whose adapter builds a grid sweep (warm-up off) into tmp_path/out,
    stepped until the grid is laid (once the ranks, here one, agree on the pool) or the
    sweep has stopped."""
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    out = tmp_path / "out"
    scheduler = make_scheduler(
        tmp_path,
        scheduler_cls=KvWarmScheduler,
        additional_config={"kvwarm_sweep": {"grid": grid, "out": str(out)}},
        **scheduler_args,
    )
    for _ in range(10):
        if scheduler.kvwarm_sweep._lay_grid is None or scheduler.kvwarm_run.finished:
            break
        step_scheduler(scheduler)
    return scheduler, out


def test_a_grid_reaches_the_prompts_the_engine_takes_with_its_doubling_tail(tmp_path, monkeypatch):
    """max_num_batched_tokens = max_model_len = 8192 and vLLM's default sizes: B = 1 runs to
    the longest prompt one step takes (8191 tokens and the one it samples), with the doubling
    tail past the largest size, at every prefix depth clamped to what is left of max_model_len.

    Written from the rule (docs/sweep-reference.md, the generated grid), not by the grid's code: the
    axis is 1, 2, 3 (the pairs 1/2 and 2/3), every size with its C + 1, the tail 1024, 2048,
    4096 and the limit 8191; cap 16 keeps the first unit, the tail and the limit (7 values)
    and fills 9 more (four pairs) in the widest log gap each time: 3..1024 -> sqrt(3 x 1024)
    = 55 -> 56/57; 3..56 -> 13 -> 16/17; 57..1024 -> 242 -> 240/241; 3..16 -> 6.9 -> 8/9."""
    _, out = _grid_sweep(
        tmp_path,
        monkeypatch,
        {"capture_sizes": DEFAULT_SIZES},
        num_blocks=4096,
        max_model_len=8192,
        max_num_batched_tokens=8192,
    )
    grid_file = json.loads((out / "grid.json").read_text())
    b1 = {}
    for p in grid_file["prefill"]:
        if p["batch_size"] == 1:
            b1.setdefault(p["total_kv_read_tokens"], []).append(p["total_prefill_tokens"])
    head = [1, 2, 3, 8, 9, 16, 17, 56, 57, 240, 241, 1024, 2048]
    assert {depth: sorted(n) for depth, n in b1.items()} == {
        0: [*head, 4096, 8191],
        2048: [*head, 4096, 8192 - 2048 - 1],
        4096: [*head, 8192 - 4096 - 1],
    }


def test_each_row_expects_the_graph_of_its_shape():
    assert expected_graph(GRAPHS, 8, 8) == {
        "expected_cudagraph_mode": "FULL",
        "expected_capture_size": 8,
        "padding_tokens": 0,
        "reasons": ["capture"],
        "observed_cudagraph_mode": None,
        "observed_size": None,
    }
    assert expected_graph(GRAPHS, 9, 9)["expected_capture_size"] == 16
    assert expected_graph(GRAPHS, 9, 9)["padding_tokens"] == 7
    assert expected_graph(GRAPHS, 9, 9)["reasons"] == ["post_capture"]
    assert expected_graph(GRAPHS, 128, 128)["reasons"] == ["capture", "engine_limit"]
    assert expected_graph(GRAPHS, 1000, 1) == {
        "expected_cudagraph_mode": "NONE",
        "expected_capture_size": None,
        "padding_tokens": 0,
        "reasons": ["eager_tail"],
        "observed_cudagraph_mode": None,
        "observed_size": None,
    }
    assert expected_graph(GRAPHS, 300, 2)["expected_cudagraph_mode"] == "PIECEWISE"
    eager = GraphConfig(capture_sizes=SIZES, max_num_seqs=128, max_num_batched_tokens=2048)
    assert expected_graph(eager, 8, 8)["reasons"] == ["cudagraph_disabled"]


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
    assert sorted(measured) == sorted(_row_key(p) for p in grid)
    assert {type(p) for p in grid} == {DecodePoint, PrefillPoint, MixedPoint}
    assert json.loads((out / "grid.json").read_text())["schema_version"] == 3  # mixed points, continuations among them
    assert artifact["kvwarm"]["grid"]["mixed_note"] is None
    assert artifact["kvwarm"]["grid"]["points"] == len(grid) and artifact["kvwarm"]["cudagraph"] == graphs.record()
    for row in artifact["results"]:  # the CPU platform captures nothing: every row eager, and says why
        graph = row["graph"]
        assert (graph["expected_cudagraph_mode"], graph["expected_capture_size"], graph["padding_tokens"]) == (
            "NONE",
            None,
            0,
        )
        assert graph["reasons"][0] == "cudagraph_disabled"
    assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def _row_key(p) -> tuple:
    """(point_type, N, K, B) as a row of the point records them (a mixed row's are its step's)."""
    if isinstance(p, MixedPoint):
        k = p.decode.total_kv_read_tokens + p.prefill.total_kv_read_tokens
        return ("mixed", p.prefill.total_prefill_tokens, k, p.decode.batch_size + p.prefill.batch_size)
    if isinstance(p, PrefillPoint):
        return ("prefill", p.total_prefill_tokens, p.total_kv_read_tokens, p.batch_size)
    return ("decode", 0, p.total_kv_read_tokens, p.batch_size)


def test_a_grid_sweeps_record_names_its_points_file_by_its_path(tmp_path, monkeypatch):
    """config.points is where the generated grid was written, so the export finds the grid's
    kinds from any working directory (before the sweep has rows of them)."""
    from vllm.kvwarm.record.export.input import SweepRecord

    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    out = tmp_path / "out"
    scheduler = make_scheduler(
        tmp_path,
        num_blocks=256,
        scheduler_cls=KvWarmScheduler,
        additional_config={"kvwarm_sweep": {"grid": CAPS, "out": str(out)}},
    )
    assert not (out / "grid.json").exists()  # the grid is laid once the ranks (here one) agree on the pool
    while scheduler.kvwarm_sweep._lay_grid is not None:
        step_scheduler(scheduler)
    artifact = json.loads((out / "sweep.json").read_text())
    assert artifact["status"] == "running" and not artifact["results"]
    assert artifact["config"]["points"] == str(out / "grid.json") and (out / "grid.json").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert SweepRecord(out, [artifact], [out / "sweep.json"]).kinds() == ["decode", "prefill"]


def _captured(scheduler, mode: str, sizes: list[int]):
    """The scheduler's real compilation config with CUDA graphs on (the CPU platform turns
    them off): `mode` and `sizes` as a GPU engine would have them."""
    from vllm.config import CUDAGraphMode

    config = scheduler.vllm_config
    config.model_config.enforce_eager = False
    config.compilation_config.cudagraph_mode = CUDAGraphMode[mode]
    config.compilation_config.cudagraph_capture_sizes = sizes
    return graph_config(config)


# (point, mode): the graph, capture size, padding and reasons a row must record; written from
# vLLM's runner (gpu_model_runner._is_uniform_decode and the CUDA-graph dispatcher, the same on
# every supported release): one token per request is a uniform decode batch by shape, and runs
# the decode graph by request count; any other batch the mixed graph by token count.
GRAPH_TABLE = [
    (DecodePoint(40, 2), "FULL_AND_PIECEWISE", ("FULL", 2, 0, ["capture"])),
    (DecodePoint(60, 3), "FULL_AND_PIECEWISE", ("FULL", 4, 1, ["post_capture"])),
    (PrefillPoint(1, 0, 1), "FULL_AND_PIECEWISE", ("FULL", 1, 0, ["capture"])),
    (PrefillPoint(4, 64, 4), "FULL_AND_PIECEWISE", ("FULL", 4, 0, ["capture"])),
    (PrefillPoint(3, 0, 3), "FULL_AND_PIECEWISE", ("FULL", 4, 1, ["post_capture"])),
    (PrefillPoint(5, 0, 1), "FULL_AND_PIECEWISE", ("PIECEWISE", 8, 3, ["post_capture"])),
    (PrefillPoint(6, 32, 2), "FULL_AND_PIECEWISE", ("PIECEWISE", 8, 2, [])),
    (PrefillPoint(20, 0, 1), "FULL_AND_PIECEWISE", ("NONE", None, 0, ["eager_tail"])),
    (PrefillPoint(2, 0, 2), "FULL_DECODE_ONLY", ("FULL", 2, 0, ["capture"])),
    (PrefillPoint(8, 0, 2), "FULL_DECODE_ONLY", ("NONE", None, 0, ["cudagraph_disabled"])),
    (PrefillPoint(2, 0, 2), "PIECEWISE", ("PIECEWISE", 2, 0, ["capture"])),
]


@pytest.mark.parametrize("mode", sorted({mode for _, mode, _ in GRAPH_TABLE}))
def test_every_row_records_the_graph_vllms_runner_dispatches_for_its_shape(tmp_path, monkeypatch, mode):
    """A sweep on a real Scheduler whose compilation config captures graphs of 1, 2, 4 and 8
    tokens: each row's graph against the table above (not against the code that labels it)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    scheduler = make_scheduler(tmp_path, num_blocks=256, scheduler_cls=KvWarmScheduler)
    graphs = _captured(scheduler, mode, [1, 2, 4, 8])
    table = [(point, expected) for point, m, expected in GRAPH_TABLE if m == mode]
    sweep = Sweep(
        [point for point, _ in table],
        None,
        SweepConfig(steady_steps=2, max_model_len=1024, real=False),
        clock=itertools.count().__next__,
        progress=lambda _: None,
        vocab_size=256,
        graphs=graphs,
    )
    scheduler.kvwarm_sweep = sweep
    for _ in range(500):
        if sweep.done:
            break
        step_scheduler(scheduler)
    rows = {(r.point_type, r.total_prefill_tokens, r.total_kv_read_tokens, r.batch_size): r.graph for r in sweep.rows}
    for point, (graph_mode, capture, padding, reasons) in table:
        n = point.total_prefill_tokens if isinstance(point, PrefillPoint) else 0
        kind = "prefill" if isinstance(point, PrefillPoint) else "decode"
        graph = rows[(kind, n, point.total_kv_read_tokens, point.batch_size)]
        assert (graph["expected_cudagraph_mode"], graph["expected_capture_size"], graph["padding_tokens"]) == (
            graph_mode,
            capture,
            padding,
        ), point
        assert graph["reasons"] == reasons, point


def test_a_grids_points_fit_the_pool_together_with_their_rung_mates(tmp_path, monkeypatch):
    """47 free blocks of 16: B = 1's chains at half of max_model_len (512 tokens) hold 32, so a
    256-token shot without a prefix (16 blocks) fits alone but not beside them. The grid
    keeps only points that fit together: each beside its rung's deepest chains."""
    _, out = _grid_sweep(tmp_path, monkeypatch, {"capture_sizes": [1, 2, 4, 8, 16, 32]}, num_blocks=48)
    points = parse_points(json.loads((out / "grid.json").read_text()), "grid.json", 1024, 3)
    prefill = [p for p in points if isinstance(p, PrefillPoint)]
    assert any(p.total_kv_read_tokens for p in prefill)

    def blocks(tokens: int) -> int:
        return -(-tokens // 16)

    for batch in {p.batch_size for p in prefill}:
        rung = [p for p in prefill if p.batch_size == batch]
        depth = max(p.total_kv_read_tokens // batch for p in rung)  # the grid's prefixes split evenly
        for p in rung:
            prefix, new = p.total_kv_read_tokens // batch, -(-p.total_prefill_tokens // batch)
            need = batch * blocks(depth) + batch * (blocks(prefix + new) - prefix // 16)
            assert need <= 47, (p, need)


def test_an_empty_config_is_a_grid_of_the_default_caps(tmp_path, monkeypatch):
    scheduler, out = _grid_sweep(tmp_path, monkeypatch, {}, num_blocks=256)
    assert (out / "grid.json").is_file() and scheduler.kvwarm_sweep is not None


def test_a_grid_with_no_point_the_engine_can_run_is_refused_with_the_limits(tmp_path, monkeypatch):
    """One block (the null block): no shot and no chain fits. It measured nothing and said
    complete with the warm-up off, and failed on an empty max() with it on. The grid is laid
    at the first step (once the ranks agree on the pool), so the sweep fails there and the
    engine serves on."""
    scheduler, out = _grid_sweep(tmp_path, monkeypatch, True, num_blocks=1)
    assert scheduler.kvwarm_run.finished
    artifact = json.loads((out / "sweep.json").read_text())
    assert artifact["status"] == "failed"
    assert "the generated grid holds no point this engine can run" in artifact["error"]
    assert "--max-model-len" in artifact["error"]


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
        assert expected_graph(graphs, 5, 5)["expected_capture_size"] == 6
        assert expected_graph(graphs, 9, 1)["expected_capture_size"] == 16
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
        assert expected_graph(graphs, 5, 5)["expected_capture_size"] == 8
