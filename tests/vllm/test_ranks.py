"""One sweep over two data-parallel ranks, on real Schedulers stepped in turn in one process
(the model runner's part played by the test), meeting through the real exchanges (torch's
TCPStore on 127.0.0.1, the default, and the file fallback): one plan from the smallest pool, a
plan mismatch, a failed rank and a rank that never comes stopping the others, prefill points
across ranks; and outside requests kept out of the timed steps. Each rank's artifacts and the
combined view: test_ranks_artifacts.py; joining the store and the settings:
test_ranks_store.py."""

from __future__ import annotations

import itertools

import pytest
from kvwarm_testing.rank_sweeps import EXCHANGES, exchanges, met, step_all, stop_on_rank_failure
from kvwarm_testing.real_kv import in_use, make_request, make_scheduler, step_scheduler
from test_sweep import make_sweep
from vllm.kvwarm.scheduler import KvWarmScheduler
from vllm.kvwarm.sweep.points import DecodePoint, PrefillPoint
from vllm.kvwarm.sweep.ranks import RankFailed


@pytest.fixture(autouse=True)
def _hashing():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def _two_ranks(tmp_path, points, kind="store", **rank_1_config):
    """Two real schedulers, each with its sweep over `points` meeting the other's through the
    exchange `kind`; rank 1's sweep may be configured differently."""
    schedulers = [make_scheduler(tmp_path / f"r{r}", num_blocks=128, scheduler_cls=KvWarmScheduler) for r in range(2)]
    made = exchanges(tmp_path, kind)
    sweeps = [make_sweep(points, exchange=made[0]), make_sweep(points, exchange=made[1], **rank_1_config)]
    for scheduler, sweep in zip(schedulers, sweeps):
        scheduler.kvwarm_sweep = sweep
    return schedulers, sweeps


@pytest.mark.parametrize("kind", EXCHANGES)
def test_ranks_with_different_free_pools_plan_the_same_rung_from_the_smallest(tmp_path, kind):
    # rank 1 has 40 blocks of 16 tokens free, rank 0 has 100: alone, rank 0 would keep
    # the rung's full depth; together both trim it to what rank 1's pool holds.
    schedulers = [
        make_scheduler(tmp_path / f"r{r}", num_blocks=n, scheduler_cls=KvWarmScheduler) for r, n in enumerate([100, 41])
    ]
    points = [DecodePoint(600, 2), DecodePoint(300, 2)]
    sweeps = [make_sweep(points, exchange=e) for e in exchanges(tmp_path, kind)]
    alone = make_sweep(points)
    schedulers[0].kvwarm_sweep, schedulers[1].kvwarm_sweep = sweeps
    step_all(schedulers)
    assert all(s.done and s.reset_prefix_cache_ok for s in sweeps)
    assert sweeps[0].stages[0]["depth"] == sweeps[1].stages[0]["depth"] < alone.rungs[0].depth
    rows = [[(r.total_kv_read_tokens, r.kv_seed_regime) for r in s.rows] for s in sweeps]
    assert rows[0] == rows[1] == [(300, "real_kv"), (600, "fake_fallback")]
    for scheduler in schedulers:
        assert in_use(scheduler.kv_cache_manager.block_pool) == {}


@pytest.mark.parametrize("kind", EXCHANGES)
def test_a_plan_mismatch_stops_every_rank_with_both_digests_and_no_hang(tmp_path, kind):
    # rank 1 was started with another repeat count: its plan (and its rows) would differ
    schedulers, sweeps = _two_ranks(tmp_path, [DecodePoint(200, 2)], kind, steady_steps=5)
    rungs = [sweep.rungs[0] for sweep in sweeps]  # each rank's first rung, planned in place when the ranks meet
    errors = []
    for sweep in sweeps:
        stop_on_rank_failure(sweep, errors)
    step_all(schedulers, limit=50)
    digests = [sweep.plan_digest(rung) for sweep, rung in zip(sweeps, rungs)]
    assert len(errors) == 2 and errors[0] == errors[1]
    assert "plan mismatch before rung batch=2" in errors[0] and all(d in errors[0] for d in digests)
    assert not any(sweep.rows for sweep in sweeps)
    for scheduler in schedulers:
        assert in_use(scheduler.kv_cache_manager.block_pool) == {}


@pytest.mark.parametrize("kind", EXCHANGES)
def test_a_rank_that_fails_stops_the_others_at_their_next_boundary(tmp_path, kind):
    schedulers, sweeps = _two_ranks(tmp_path, [DecodePoint(200, 2), DecodePoint(100, 2), DecodePoint(50, 2)], kind)
    errors = []
    stop_on_rank_failure(sweeps[0], errors)

    def fail_rank_1_after_its_first_point(s, original=sweeps[1].before_schedule):
        if sweeps[1].rows:
            sweeps[1].abandon(s, "RuntimeError: rank 1 lost its worker")
            return
        original(s)

    sweeps[1].before_schedule = fail_rank_1_after_its_first_point
    step_all(schedulers, limit=200)
    assert errors == ["rank 1 failed: RuntimeError: rank 1 lost its worker"]
    assert len(sweeps[0].rows) == 1  # measured together before rank 1 stopped
    for scheduler in schedulers:
        assert in_use(scheduler.kv_cache_manager.block_pool) == {}


@pytest.mark.parametrize("kind", EXCHANGES)
def test_a_rank_that_never_comes_is_given_up_on_after_the_timeout(tmp_path, kind):
    now = [0.0]
    rank_0, rank_1 = exchanges(tmp_path, kind, timeout=5.0, clock=lambda: now[0], start_timeout=50.0)
    rank_0.post("pool", {"usable_blocks": 10})
    now[0] = 30.0  # the first boundary waits for the ranks to start: longer than the timeout
    assert rank_0.poll() is None
    rank_1.post("pool", {"usable_blocks": 10})  # rank 1 comes to boundary 1 ...
    assert len(met(rank_0)) == 2
    rank_0.post("plan", {"digest": "d"})  # ... but never to boundary 2
    assert rank_0.poll() is None
    now[0] = 36.0
    with pytest.raises(RankFailed, match=r"rank\(s\) \[1\] did not reach boundary 2 \(plan\) within 5 s"):
        rank_0.poll()
    if kind == "store":  # what rank 0's combined view will say of rank 1
        assert rank_0.lost == {1: "rank(s) [1] did not reach boundary 2 (plan) within 5 s"}


# --- prefill points across ranks -----------------------------------------------------------------
def _prefill_sweep(points, exchange):
    from vllm.kvwarm.sweep.controller import Sweep
    from vllm.kvwarm.sweep.plan import SweepConfig

    return Sweep(
        points,
        lambda i, n: [(i * 37 + 13 * t) % 200 + 3 for t in range(n)],
        SweepConfig(steady_steps=3, max_model_len=1024),
        clock=itertools.count().__next__,
        progress=lambda _: None,
        exchange=exchange,
        tail_tokens=[(11 * t) % 190 + 5 for t in range(500)],
        vocab_size=256,
    )


def _prefill_shots(outputs) -> int:
    from vllm.kvwarm.sweep.prefill import PREFILL_PREFIX

    return sum(any(r.req_id.startswith(PREFILL_PREFIX) for r in o.scheduled_new_reqs) for o in outputs)


def test_prefill_points_on_two_ranks_run_a_warm_and_a_trailing_shot_around_the_timed_ones(tmp_path):
    """Ranks that start a point a step apart: each rank's timed shots run beside the other's
    shots of the same shape; the warm shot before and one untimed shot after take the edges."""
    points = [PrefillPoint(64, 64, 2), PrefillPoint(32, 0, 2)]
    schedulers = [make_scheduler(tmp_path / f"r{r}", num_blocks=192, scheduler_cls=KvWarmScheduler) for r in range(2)]
    sweeps = [_prefill_sweep(points, e) for e in exchanges(tmp_path)]
    outputs = [[], []]
    for scheduler, sweep in zip(schedulers, sweeps):
        scheduler.kvwarm_sweep = sweep
    for _ in range(2000):
        busy = [r for r in range(2) if schedulers[r].has_requests()]
        if not busy:
            break
        for r in busy:
            outputs[r].append(step_scheduler(schedulers[r]))
    for sweep, steps in zip(sweeps, outputs):
        assert [(r.kv_seed_regime, len(r.samples)) for r in sweep.rows] == [("real_prefix", 3), ("not_applicable", 3)]
        assert _prefill_shots(steps) == 2 * (1 + 3 + 1)  # per point: warm, three timed, trailing
    alone = _prefill_sweep(points, None)
    scheduler = make_scheduler(tmp_path / "alone", num_blocks=192, scheduler_cls=KvWarmScheduler)
    scheduler.kvwarm_sweep = alone
    steps = [step_scheduler(scheduler) for _ in range(2000) if scheduler.has_requests()]
    assert _prefill_shots(steps) == 2 * (1 + 3)  # one rank: nothing to trail


def test_a_prefix_lost_on_one_rank_rebuilds_the_chains_on_every_rank(tmp_path, monkeypatch):
    """Rank 1 finds the point's prefix uncached: both ranks build their chains again (a
    restage every rank takes part in), then meet again; rank 1's prefix stays lost, so it
    skips the point, rank 0 measures it, and both go on together."""
    from vllm.kvwarm.sweep import prefill as prefill_module

    schedulers = [make_scheduler(tmp_path / f"r{r}", num_blocks=192, scheduler_cls=KvWarmScheduler) for r in range(2)]
    lookup = prefill_module.cached_tokens
    lost = schedulers[1].kv_cache_manager
    monkeypatch.setattr(prefill_module, "cached_tokens", lambda kvm, r: 0 if kvm is lost else lookup(kvm, r))
    points = [PrefillPoint(64, 64, 2), PrefillPoint(32, 0, 2)]
    sweeps = [_prefill_sweep(points, e) for e in exchanges(tmp_path)]
    for scheduler, sweep in zip(schedulers, sweeps):
        scheduler.kvwarm_sweep = sweep
    step_all(schedulers)
    assert [len(s.stages) for s in sweeps] == [2, 2]  # built, then built again, on both ranks
    assert [r.kv_seed_regime for r in sweeps[0].rows] == ["real_prefix", "not_applicable"]
    assert [r.kv_seed_regime for r in sweeps[1].rows] == ["skip:real_seed_cache_validation_failed", "not_applicable"]
    for scheduler in schedulers:
        assert in_use(scheduler.kv_cache_manager.block_pool) == {}


# --- requests from outside the sweep ----------------------------------------------------------


def test_requests_from_outside_wait_while_a_point_is_measured_and_run_between_points(tmp_path):
    scheduler = make_scheduler(tmp_path, num_blocks=256, scheduler_cls=KvWarmScheduler)
    sweep = make_sweep([DecodePoint(300, 2), DecodePoint(200, 2), DecodePoint(120, 2), DecodePoint(90, 3)])
    scheduler.kvwarm_sweep = sweep
    seen, measuring = [], sweep.measuring  # what the adapter asked in each schedule()
    sweep.measuring = lambda: seen.append(measuring()) or seen[-1]
    foreign_steps = []
    for step in range(1000):
        if step % 7 == 3 and step < 300:  # users keep sending requests during the sweep
            scheduler.add_request(make_request(f"user-{step}", 20 + step % 11))
        if not scheduler.has_requests():
            break
        asked = len(seen)
        output = step_scheduler(scheduler)
        allowed = seen[-1] if len(seen) > asked else None
        users = [r for r in output.num_scheduled_tokens if r.startswith("user-")]
        if users:
            foreign_steps.append(step)
            assert allowed is None, f"step {step} ran {users} while a point was measured"
    assert sweep.done and foreign_steps
    assert [r.kv_seed_regime for r in sweep.rows] == ["real_kv"] * 4  # none skipped for a batch mismatch
    assert not [r for r in scheduler.requests if r.startswith("user-")]  # every user request finished
    assert sweep.reset_prefix_cache_ok is True  # the leak check waited for them
    assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_a_sweep_ends_without_its_leak_check_when_outside_requests_outlast_the_wait(tmp_path):
    from vllm.kvwarm.sweep.leak_check import END_WAIT_SECONDS

    scheduler = make_scheduler(tmp_path, num_blocks=256, scheduler_cls=KvWarmScheduler)
    endless = make_request("user-endless", 20)
    endless.sampling_params.max_tokens = endless.max_tokens = 900
    scheduler.add_request(endless)
    sweep = make_sweep([DecodePoint(120, 2)])  # its clock ticks a second per reading
    scheduler.kvwarm_sweep = sweep
    for _ in range(int(END_WAIT_SECONDS) + 200):
        if sweep.done:
            break
        step_scheduler(scheduler)
    assert sweep.done and sweep.reset_prefix_cache_ok is None and "user-endless" in scheduler.requests
    assert [r.kv_seed_regime for r in sweep.rows] == ["real_kv"]
