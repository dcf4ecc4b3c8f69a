"""The decode sweep controller stepped against a real Scheduler (sync and async), with the
model runner's part played by the test and a clock the test controls."""

from __future__ import annotations

import itertools

import pytest
from real_kv import in_use, make_scheduler, step_scheduler

from vllm.kvwarm.points import DecodePoint
from vllm.kvwarm.scheduler import KvWarmAsyncScheduler, KvWarmScheduler
from vllm.kvwarm.sweep import DecodeSweep, plan_rungs

REPEATS = 3


@pytest.fixture(autouse=True)
def _hashing():
    """What the engine core does at start-up before any request is hashed."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def _tokens(i: int, depth: int) -> list[int]:
    return [(7 * i + 3 * t) % 200 + 2 for t in range(depth)]


def test_rungs_are_one_per_batch_size_deepest_first():
    points = [DecodePoint(200, 2), DecodePoint(90, 3), DecodePoint(500, 2), DecodePoint(30, 3)]
    rungs = plan_rungs(points, repeats=3, max_model_len=1024)
    assert [(r.batch_size, r.depth, [p.total_kv_read_tokens for p in r.points]) for r in rungs] == [
        (3, 30 + 1 + 3, [90, 30]), (2, 250 + 1 + 3, [500, 200])]


@pytest.mark.parametrize("cls", [KvWarmScheduler, KvWarmAsyncScheduler], ids=["sync", "async"])
def test_a_sweep_measures_every_point_on_real_kv_and_leaves_nothing_behind(tmp_path, cls):
    scheduler = make_scheduler(tmp_path, num_blocks=256, scheduler_cls=cls)
    ticks = itertools.count()
    points = [DecodePoint(300, 2), DecodePoint(120, 2), DecodePoint(90, 3)]
    sweep = DecodeSweep(points, _tokens, repeats=REPEATS, max_model_len=1024,
                        clock=lambda: float(next(ticks)), progress=lambda _: None)
    scheduler.kvwarm_sweep = sweep
    steps = 0
    while scheduler.has_requests() and steps < 500:
        step_scheduler(scheduler)
        steps += 1
    assert sweep.done and sweep.reset_prefix_cache_ok
    assert [(r.total_kv_read_tokens, r.batch_size, r.kv_seed_regime) for r in sweep.rows] == [
        (90, 3, "real_kv"), (300, 2, "real_kv"), (120, 2, "real_kv")]
    for row in sweep.rows:
        assert len(row.steady_seconds) == REPEATS and all(t > 0 for t in row.steady_seconds)
        assert row.median_seconds == sorted(row.steady_seconds)[1]
        assert row.sample_reasons == ["kvwarm_real_kv"]
    assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_a_point_that_cannot_be_admitted_is_skipped_with_its_reason(tmp_path):
    # The batch-2 rung's chains (2 x 10 blocks) leave one free block, its point's two
    # shadows need one each; the batch-1 rung comes after those chains are shed.
    scheduler = make_scheduler(tmp_path, num_blocks=22, scheduler_cls=KvWarmScheduler)
    points = [DecodePoint(300, 2), DecodePoint(20, 1)]
    sweep = DecodeSweep(points, _tokens, repeats=REPEATS, max_model_len=1024, progress=lambda _: None)
    scheduler.kvwarm_sweep = sweep
    for _ in range(300):
        if not scheduler.has_requests():
            break
        step_scheduler(scheduler)
    regimes = [(r.total_kv_read_tokens, r.kv_seed_regime) for r in sweep.rows]
    assert regimes[1] == (20, "real_kv")
    assert sweep.done and sweep.reset_prefix_cache_ok
    assert in_use(scheduler.kv_cache_manager.block_pool) == {}
    assert regimes[0] == (300, "skip:decode_injection_failed") and "pool_exhausted" in sweep.rows[0].detail
