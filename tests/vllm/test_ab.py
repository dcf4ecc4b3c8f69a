"""Real and fake KV in one boot (sweep.ab): the controller stepped against a real Scheduler (the
model runner's part played by the test) measures every point both ways back to back, of the same
shape, the sides alternating by the point's index, the fake side beside the resident chains,
whose depth leaves it room; and every reader of an A/B artifact takes its real side as the table
(runs, report, the exports, validate's predictor, the combined view), while `report` of the one
artifact gives the A/B against figures computed by hand."""

from __future__ import annotations

import itertools
import json

import pytest
from export_helpers import dp_sweep, dynamo_files, write_rank
from kvwarm_testing.real_kv import in_use, make_scheduler, step_scheduler
from vllm.kvwarm.record import vocabulary as v
from vllm.kvwarm.record.artifact import PointRow
from vllm.kvwarm.record.export.input import load_sweep
from vllm.kvwarm.record.report import run as report
from vllm.kvwarm.record.runs import load_run
from vllm.kvwarm.record.schema import validate
from vllm.kvwarm.record.validate.validation import predictors
from vllm.kvwarm.scheduler import KvWarmScheduler
from vllm.kvwarm.sweep.controller import Sweep
from vllm.kvwarm.sweep.plan import SweepConfig
from vllm.kvwarm.sweep.points import DecodePoint, PrefillPoint

STEPS = 3


@pytest.fixture(autouse=True)
def _hashing():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def _tokens(i: int, depth: int) -> list[int]:
    return [(7 * i + 3 * t) % 200 + 2 for t in range(depth)]


def _ab_sweep(points) -> Sweep:
    config = SweepConfig(steady_steps=STEPS, max_model_len=1024, ab=True)
    return Sweep(
        points,
        _tokens,
        config,
        clock=itertools.count().__next__,
        progress=lambda _: None,
        tail_tokens=[(11 * t) % 190 + 5 for t in range(500)],
        vocab_size=256,
    )


def _run(scheduler, sweep) -> None:
    scheduler.kvwarm_sweep = sweep
    for _ in range(1500):
        if not scheduler.has_requests():
            break
        step_scheduler(scheduler)
    assert sweep.done and sweep.reset_prefix_cache_ok
    assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_every_point_is_measured_both_ways_back_to_back_alternating_which_side_goes_first(tmp_path):
    scheduler = make_scheduler(tmp_path, num_blocks=256, scheduler_cls=KvWarmScheduler)
    points = [DecodePoint(300, 2), DecodePoint(120, 2), DecodePoint(90, 3), PrefillPoint(64, 96, 2)]
    sweep = _ab_sweep(points)
    _run(scheduler, sweep)
    got = [(r.point_type, r.total_kv_read_tokens, r.batch_size, r.ab, r.ab_first, r.kv_seed_regime) for r in sweep.rows]
    # the prefill rung first, then the decode rungs deepest batch first; at an even index the real side first
    assert got == [
        ("prefill", 96, 2, "fake", True, "fake_prefix"),
        ("prefill", 96, 2, "real", False, "real_prefix"),
        ("decode", 90, 3, "real", True, "real_kv"),
        ("decode", 90, 3, "fake", False, "legacy"),
        ("decode", 300, 2, "real", True, "real_kv"),
        ("decode", 300, 2, "fake", False, "legacy"),
        ("decode", 120, 2, "fake", True, "legacy"),
        ("decode", 120, 2, "real", False, "real_kv"),
    ]
    for row in sweep.rows:  # the same shape and as many timed samples on both sides
        assert len(row.samples) == STEPS and not row.skipped
    assert [(s["batch"], s["depth"]) for s in sweep.stages] == [(2, 48), (3, 33), (2, 153)]  # each rung built once


def test_the_chains_leave_the_fake_side_room_beside_them(tmp_path):
    # 41 free blocks of 16 tokens. Without --ab the batch-2 rung's chains are 288 tokens (18
    # blocks each; test_sweep's tight pool). With it, the fake side's two requests must fit
    # beside the two chains: 4 x 10 blocks, 160 tokens. The 300-token point (contexts 150) is
    # covered, the 600-token one is not: both its sides on fake KV once the chains are gone.
    scheduler = make_scheduler(tmp_path, num_blocks=42, scheduler_cls=KvWarmScheduler)
    sweep = _ab_sweep([DecodePoint(600, 2), DecodePoint(300, 2)])
    _run(scheduler, sweep)
    ((_, depth),) = [(s["batch"], s["depth"]) for s in sweep.stages]
    assert depth == 160
    assert [(r.total_kv_read_tokens, r.ab, r.kv_seed_regime) for r in sweep.rows] == [
        (300, "fake", "legacy"),
        (300, "real", "real_kv"),
        (600, "real", "fake_fallback"),
        (600, "fake", "legacy"),
    ]


def _rows(real_ms: tuple, fake_ms: tuple) -> list[PointRow]:
    """An A/B sweep's rows at K = 1000 and 2000 (B = 4): each side's three samples around its median."""
    rows = []
    for i, (real, fake) in enumerate(zip(real_ms, fake_ms)):
        k = 1000 * (i + 1)
        for side, ms, regime in ((v.AB_REAL, real, v.REAL_KV), (v.AB_FAKE, fake, v.LEGACY)):
            samples = [ms / 1e3 * f for f in (0.99, 1.0, 1.01)]
            rows.append(
                PointRow(k, 4, regime, [], samples, ms / 1e3, ab=side, ab_first=(side == v.AB_REAL) == (i % 2 == 0))
            )
    return rows


def test_an_ab_artifact_holds_its_real_side_as_the_table_and_its_fake_side_apart(tmp_path):
    artifact = write_rank(tmp_path / "ab", _rows((10.0, 20.0), (9.0, 21.0)))
    validate(artifact)
    assert [(r["point"]["total_kv_read_tokens"], r["ab"]) for r in artifact["results"]] == [
        (1000, "real"),
        (2000, "real"),
    ]
    fake = artifact[v.AB_FAKE_SIDE]["results"]
    assert [(r["point"]["total_kv_read_tokens"], r["kv_seed_regime"], r["ab"]) for r in fake] == [
        (1000, "legacy", "fake"),
        (2000, "legacy", "fake"),
    ]
    assert artifact["kvwarm"]["points_real_kv"] == 2  # the table's counts
    run = load_run(str(tmp_path / "ab"))
    assert [row.regime for row in run.rows] == ["real_kv", "real_kv"]
    assert [row.median_ms for row in run.fake_side] == pytest.approx([9.0, 21.0])
    # the exports and validate's predictor read the table: the real side
    sweep = load_sweep(tmp_path / "ab")
    assert sweep.ab
    (decode,) = dynamo_files(tmp_path / "ab", tmp_path / "dynamo" / "benchmark.json")
    assert [r["kvwarm_sweep"]["kv_seed_regime"] for r in decode["results"]] == ["real_kv", "real_kv"]
    (predictor,) = predictors(sweep, "step")
    assert [predictor.decode_step(4, k).ms for k in (1000, 2000)] == pytest.approx([10.0, 20.0])


def test_report_of_one_ab_artifact_gives_the_ratio_per_point_and_the_mape(tmp_path, capsys):
    write_rank(tmp_path / "ab", _rows((10.0, 20.0), (9.0, 21.0)))
    assert report([str(tmp_path / "ab"), "--out", str(tmp_path / "report")]) == 0
    out = capsys.readouterr().out
    # by hand: 9 / 10 = 0.9, 21 / 20 = 1.05; MAPE (10% + 5%) / 2 = 7.5%
    assert "A/B in one boot (fake KV against real KV, the same engine):" in out
    assert "B = ab fake KV against A = ab real KV" in out
    assert "     1000    4       10.000        9.000   0.900  real_kv / legacy" in out
    assert "     2000    4       20.000       21.000   1.050  real_kv / legacy" in out
    assert "MAPE of B against A over 2 joined point(s): 7.50%" in out
    page = (tmp_path / "report" / "report.html").read_text()
    assert "A/B in one boot: ab fake KV (B) against ab real KV (A)" in page and "MAPE of B against A: 7.50%" in page
    csv_lines = (tmp_path / "report" / "report.csv").read_text().splitlines()
    assert any(line.startswith("ab fake KV,") and ",ab real KV,10.0000,0.9000," in line for line in csv_lines)


def test_the_combined_view_of_an_ab_sweep_merges_each_side_apart(tmp_path):
    dp_sweep(tmp_path, [_rows((10.0, 20.0), (9.0, 21.0)), _rows((11.0, 19.0), (9.5, 22.0))])
    combined = json.loads((tmp_path / "sweep.json").read_text())
    validate(combined)
    assert [r["median_seconds"] * 1e3 for r in combined["results"]] == pytest.approx([11.0, 20.0])
    fake = combined[v.AB_FAKE_SIDE]["results"]
    assert [r["median_seconds"] * 1e3 for r in fake] == pytest.approx([9.5, 22.0])  # the slower rank's
    assert [len(r["ranks"]) for r in fake] == [2, 2]


def test_the_fake_side_crosses_the_store_to_rank_0s_combined_view(tmp_path):
    """Through the real store exchange: rank 1's fake side travels as rows of their own (its
    summary stays a head without rows), and rank 0's combined view merges each side apart."""
    from kvwarm_testing.rank_sweeps import exchanges, until
    from vllm.kvwarm.record.artifact import KvwarmMeta, build_artifact

    rank_0, rank_1 = exchanges(tmp_path, "store")
    meta = KvwarmMeta(ab={"first": "alternate"})
    layouts = [{**_LAYOUT, "data_parallel_rank": r} for r in range(2)]
    sides = [_rows((10.0, 20.0), (9.0, 21.0)), _rows((11.0, 19.0), (9.5, 22.0))]
    for exchange, rows, layout in zip((rank_1, rank_0), sides[::-1], layouts[::-1]):
        exchange.share(build_artifact(rows, meta, {}, "complete", layout=layout))
    path = tmp_path / "out0" / "sweep.json"

    def final() -> dict | None:
        combined = json.loads(path.read_text()) if path.exists() else {}
        return combined if combined.get("status") == "complete" else None

    combined = until(final, "no final combined view", 60)
    assert [r["median_seconds"] * 1e3 for r in combined["results"]] == pytest.approx([11.0, 20.0])
    fake = combined[v.AB_FAKE_SIDE]["results"]
    assert [r["median_seconds"] * 1e3 for r in fake] == pytest.approx([9.5, 22.0])
    assert [[x["rank"] for x in r["ranks"]] for r in fake] == [[0, 1], [0, 1]]
    for exchange in (rank_0, rank_1):
        exchange.close()


_LAYOUT = {"data_parallel_size": 2, "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "expert_parallel": False}
