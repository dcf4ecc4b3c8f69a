"""The decode sweep controller stepped against a real Scheduler (sync and async), with the
model runner's part played by the test and a clock the test controls."""

from __future__ import annotations

import itertools

import pytest
from kvwarm_testing.real_kv import in_use, make_scheduler, step_scheduler
from vllm.kvwarm.scheduler import KvWarmAsyncScheduler, KvWarmScheduler
from vllm.kvwarm.sweep.controller import Sweep
from vllm.kvwarm.sweep.plan import SweepConfig, plan_rungs
from vllm.kvwarm.sweep.points import DecodePoint

REPEATS = 3


@pytest.fixture(autouse=True)
def _hashing():
    """What the engine core does at start-up before any request is hashed."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def _tokens(i: int, depth: int) -> list[int]:
    return [(7 * i + 3 * t) % 200 + 2 for t in range(depth)]


def make_sweep(points, chain_tokens=_tokens, *, clock=None, exchange=None, **config) -> Sweep:
    """A sweep with the test's settings; its clock ticks one second per reading, so step
    times are exact (and no row is stamped noisy by the host's jitter)."""
    config = SweepConfig(**{"steady_steps": REPEATS, "max_model_len": 1024, **config})
    ticks = itertools.count()
    return Sweep(
        points,
        chain_tokens,
        config,
        clock=clock or (lambda: float(next(ticks))),
        progress=lambda _: None,
        exchange=exchange,
    )


def test_rungs_are_one_per_batch_size_deepest_first():
    points = [DecodePoint(200, 2), DecodePoint(90, 3), DecodePoint(500, 2), DecodePoint(30, 3)]
    rungs = plan_rungs(points, decode_steps=3, max_model_len=1024)
    assert [(r.batch_size, r.depth, [p.total_kv_read_tokens for p in r.points]) for r in rungs] == [
        (3, 29 + 1 + 3, [90, 30]),
        (2, 249 + 1 + 3, [500, 200]),
    ]  # one token short, admission, steady


@pytest.mark.parametrize("cls", [KvWarmScheduler, KvWarmAsyncScheduler], ids=["sync", "async"])
def test_a_sweep_measures_every_point_on_real_kv_and_leaves_nothing_behind(tmp_path, cls):
    scheduler = make_scheduler(tmp_path, num_blocks=256, scheduler_cls=cls)
    points = [DecodePoint(300, 2), DecodePoint(120, 2), DecodePoint(90, 3)]
    sweep = make_sweep(points)
    scheduler.kvwarm_sweep = sweep
    steps = 0
    while scheduler.has_requests() and steps < 500:
        step_scheduler(scheduler)
        steps += 1
    assert sweep.done and sweep.reset_prefix_cache_ok
    assert [(r.total_kv_read_tokens, r.batch_size, r.kv_seed_regime) for r in sweep.rows] == [
        (90, 3, "real_kv"),
        (300, 2, "real_kv"),
        (120, 2, "real_kv"),
    ]
    for row in sweep.rows:
        assert len(row.samples) == REPEATS and all(t > 0 for t in row.samples)
        assert row.median_seconds == sorted(row.samples)[1]
        assert row.sample_reasons == ["kvwarm_real_kv"]
    assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def _run(scheduler, sweep, limit: int = 600) -> None:
    scheduler.kvwarm_sweep = sweep
    for _ in range(limit):
        if not scheduler.has_requests():
            break
        step_scheduler(scheduler)
    assert sweep.done and sweep.reset_prefix_cache_ok
    assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_a_tight_pool_trims_the_chains_and_measures_what_they_cannot_cover_on_fake_kv(tmp_path):
    # 41 free blocks of 16 tokens: two 303-token chains (19 blocks each) plus two worst-case
    # shadow tails (2 each) would take 42, so the batch-2 rung is trimmed to 288 tokens
    # (18 blocks each); the 300-token point (contexts 150) is still covered, the 600-token
    # one (contexts 300) is not: it runs on fake KV, last, after the chains are shed.
    scheduler = make_scheduler(tmp_path, num_blocks=42, scheduler_cls=KvWarmScheduler)
    sweep = make_sweep([DecodePoint(600, 2), DecodePoint(300, 2)])
    _run(scheduler, sweep)
    assert [(r.total_kv_read_tokens, r.kv_seed_regime, r.sample_reasons) for r in sweep.rows] == [
        (300, "real_kv", ["kvwarm_real_kv"]),
        (600, "fake_fallback", ["kvwarm_fake_fallback"]),
    ]
    assert len(sweep.rows[1].samples) == 1  # below the giant-KV threshold: the legacy single step
    (stage,) = sweep.stages
    assert stage["batch"] == 2 and stage["depth"] == 288


def test_a_point_that_cannot_be_admitted_is_skipped_with_its_reason(tmp_path):
    scheduler = make_scheduler(tmp_path, num_blocks=64, scheduler_cls=KvWarmScheduler)
    queue = scheduler.kvwarm_injector.queue

    def queue_after_something_else_took_the_pool(point):
        pool = scheduler.kv_cache_manager.block_pool
        taken.extend(pool.get_new_blocks(pool.get_num_free_blocks()))
        return queue(point)

    taken = []
    scheduler.kvwarm_injector.queue = queue_after_something_else_took_the_pool
    sweep = make_sweep([DecodePoint(300, 2)])
    scheduler.kvwarm_sweep = sweep
    for _ in range(100):
        if sweep.rows:
            break
        step_scheduler(scheduler)
    (row,) = sweep.rows
    assert row.kv_seed_regime == "skip:decode_injection_failed" and "pool_exhausted" in row.detail
    scheduler.kv_cache_manager.block_pool.free_blocks(taken)
    _run(scheduler, sweep)


def test_warm_up_off_measures_every_point_on_fake_kv_without_chains(tmp_path):
    scheduler = make_scheduler(tmp_path, num_blocks=256, scheduler_cls=KvWarmAsyncScheduler)
    sweep = make_sweep(
        [DecodePoint(300, 2), DecodePoint(90, 3), DecodePoint(2_000, 2)],
        None,
        real=False,
        fake_regime="legacy",
        giant_kv_threshold=1_000,
    )
    _run(scheduler, sweep)
    assert not sweep.stages and not any(r.request_id.startswith("__kvwarm_chain") for r in scheduler.requests.values())
    assert [
        (r.total_kv_read_tokens, r.batch_size, r.kv_seed_regime, len(r.samples), r.sample_reasons) for r in sweep.rows
    ] == [(90, 3, "legacy", 1, []), (2_000, 2, "legacy", REPEATS, []), (300, 2, "legacy", 1, [])]


def test_a_point_with_one_token_contexts_is_measured_at_two_and_stamped_clamped(tmp_path):
    scheduler = make_scheduler(tmp_path, num_blocks=64, scheduler_cls=KvWarmScheduler)
    sweep = make_sweep([DecodePoint(3, 2), DecodePoint(64, 2)])
    _run(scheduler, sweep)
    # contexts [2, 1]: admitted at [1, 1], so the steps read 4 tokens of KV, not 3
    assert [(r.total_kv_read_tokens, r.kv_seed_regime, r.sample_reasons) for r in sweep.rows] == [
        (64, "real_kv", ["kvwarm_real_kv"]),
        (4, "real_kv", ["context_clamped", "kvwarm_real_kv"]),
    ]


def test_in_place_rows_after_the_first_use_of_a_chain_are_stamped_drifted(tmp_path):
    scheduler = make_scheduler(
        tmp_path, num_blocks=128, scheduler_cls=KvWarmScheduler, block_size=32, state_block_size=32
    )
    sweep = make_sweep([DecodePoint(200, 2), DecodePoint(120, 2), DecodePoint(40, 1)], state_mode="inplace")
    _run(scheduler, sweep)
    stamps = {(r.total_kv_read_tokens, r.batch_size): r.sample_reasons for r in sweep.rows}
    assert stamps[(200, 2)] == ["kvwarm_real_kv", "kvwarm_state_inplace", "kvwarm_state_depth=103"]
    assert stamps[(120, 2)] == [
        "kvwarm_real_kv",
        "kvwarm_state_inplace",
        "kvwarm_state_depth=103",
        "kvwarm_state_drifted",
    ]
    # a new rung's chains are fresh requests (their state is recomputed by their prefill)
    assert stamps[(40, 1)] == ["kvwarm_real_kv", "kvwarm_state_inplace", "kvwarm_state_depth=43"]


def test_a_point_at_the_edge_of_max_model_len_is_measured_on_real_kv(tmp_path):
    # context 1020 + admission + 3 steady steps = max_model_len 1024; a chain that deep
    # would be finished by length once it samples, so it stops a margin short (1020 tokens),
    # which still holds every token the shadow borrows.
    scheduler = make_scheduler(tmp_path, num_blocks=160, scheduler_cls=KvWarmScheduler)
    sweep = make_sweep([DecodePoint(1020, 1)])
    _run(scheduler, sweep)
    assert [(r.kv_seed_regime, len(r.samples)) for r in sweep.rows] == [("real_kv", REPEATS)]
    assert sweep.stages[0]["depth"] == 1020


@pytest.mark.parametrize(("mode", "reused"), [("copy", True), ("inplace", False)])
def test_later_rungs_reuse_earlier_chains_only_where_their_state_was_not_advanced(tmp_path, mode, reused):
    scheduler = make_scheduler(
        tmp_path, num_blocks=128, scheduler_cls=KvWarmScheduler, block_size=32, state_block_size=32
    )
    salts = []
    add = scheduler.add_request
    scheduler.add_request = lambda request: (salts.append(request.cache_salt), add(request))[1]
    sweep = make_sweep([DecodePoint(200, 2), DecodePoint(90, 1)], state_mode=mode)
    _run(scheduler, sweep)
    first_rung, second_rung = salts[:2], salts[2:]
    assert (second_rung[0] == first_rung[0]) is reused


@pytest.mark.parametrize("cls", [KvWarmScheduler, KvWarmAsyncScheduler], ids=["sync", "async"])
def test_exact_rows_borrow_from_catch_ups_that_start_at_the_last_cached_boundary(tmp_path, cls):
    """Exact mode: the chains are prefilled one state block per step (every boundary's state
    cached), each shadow's catch-up finds the chain's state at the last boundary before its
    context and computes the rest, and is parked there (never decoded); rows are stamped with
    the point's own context; the prefill cap is put back."""
    scheduler = make_scheduler(tmp_path, num_blocks=160, scheduler_cls=cls, block_size=32, state_block_size=32)
    chunks, catchups = [], []
    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        output = schedule(*args, **kwargs)
        chunks.extend(n for r, n in output.num_scheduled_tokens.items() if "chain_b" in r)
        catchups.extend((scheduler.requests[r], n) for r, n in output.num_scheduled_tokens.items() if "catchup" in r)
        return output

    scheduler.schedule = recording_schedule
    sweep = make_sweep([DecodePoint(200, 2), DecodePoint(150, 2)], state_mode="exact", state_lending="inplace")
    _run(scheduler, sweep)
    assert [(r.total_kv_read_tokens, r.kv_seed_regime, r.sample_reasons) for r in sweep.rows] == [
        (200, "real_kv", ["kvwarm_real_kv", "kvwarm_state_exact", "kvwarm_state_depth=100"]),
        (150, "real_kv", ["kvwarm_real_kv", "kvwarm_state_exact", "kvwarm_state_depth=75"]),
    ]
    assert max(chunks) == 32  # the chains: one state block per step
    # contexts 99 and 74 (one short): from the boundaries 96 and 64, one step each, never decoded
    assert sorted((r.num_prompt_tokens, n) for r, n in catchups) == [(74, 10), (74, 10), (99, 3), (99, 3)]
    assert scheduler.scheduler_config.long_prefill_token_threshold == 0


def test_an_exact_point_whose_catch_ups_do_not_fit_is_skipped_after_the_ranks_meet(tmp_path, monkeypatch):
    """As if every boundary state had been evicted: each catch-up would recompute its whole
    context, which this pool cannot hold beside the chains, so the point is skipped, named,
    without adding a catch-up; the sweep goes on to the next point and ends clean."""
    from vllm.kvwarm.sweep import catchups

    scheduler = make_scheduler(
        tmp_path, num_blocks=40, scheduler_cls=KvWarmScheduler, block_size=32, state_block_size=32
    )
    lookups = []
    monkeypatch.setattr(catchups, "cached_tokens", lambda kvm, request: lookups.append(request) or 0)
    meetings = []
    sweep = make_sweep([DecodePoint(600, 2), DecodePoint(40, 2)], state_mode="exact", state_lending="inplace")
    post = sweep._meetings.exchange.post
    sweep._meetings.exchange.post = lambda kind, record: (meetings.append(kind), post(kind, record))[1]
    _run(scheduler, sweep)
    first, second = sweep.rows
    assert first.kv_seed_regime == "skip:decode_injection_failed" and "pool_exhausted" in first.detail
    assert second.kv_seed_regime == "real_kv"
    assert meetings.count("caught_up") == 2  # the skipped point's meeting too
    assert not [r for r in scheduler.requests if "catchup" in r]
