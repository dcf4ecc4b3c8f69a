"""One sweep over several data-parallel ranks, on real Schedulers: two ranks stepped in turn in
one process (the model runner's part played by the test), meeting through the real file
exchange, with per-rank artifacts and the combined view; outside requests kept out of
the timed steps."""

from __future__ import annotations

import json

import pytest
from kvwarm_testing.real_kv import in_use, make_request, make_scheduler, step_scheduler
from test_sweep import make_sweep
from vllm.kvwarm.record.schema import validate
from vllm.kvwarm.scheduler import KvWarmScheduler
from vllm.kvwarm.sweep import ranks
from vllm.kvwarm.sweep.points import DecodePoint
from vllm.kvwarm.sweep.ranks import FileExchange, RankFailed
from vllm.kvwarm.sweep.run import SweepRun


@pytest.fixture(autouse=True)
def _hashing():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def _step_all(schedulers, limit: int = 2000) -> int:
    """Step every rank in turn until none has work; returns the rounds taken."""
    for rounds in range(limit):
        busy = [s for s in schedulers if s.has_requests()]
        if not busy:
            return rounds
        for scheduler in busy:
            step_scheduler(scheduler)
    raise AssertionError("the ranks did not finish (a hang)")


def _stop_on_rank_failure(sweep, errors: list) -> None:
    """What the adapter does under a configured run, for a bare sweep: a RankFailed ends the
    sweep (its requests given back, the others told) and is collected instead of raised."""
    original = sweep.before_schedule

    def before_schedule(scheduler):
        try:
            original(scheduler)
        except RankFailed as err:
            errors.append(str(err))
            sweep.abandon(scheduler, str(err))

    sweep.before_schedule = before_schedule


def _exchanges(tmp_path, size=2, timeout=60.0):
    return [FileExchange(tmp_path / "out", "run", size, rank, timeout=timeout) for rank in range(size)]


def _two_ranks(tmp_path, points, **rank_1_config):
    """Two real schedulers, each with its sweep over `points` meeting the other's through the
    file exchange; rank 1's sweep may be configured differently."""
    schedulers = [make_scheduler(tmp_path / f"r{r}", num_blocks=128, scheduler_cls=KvWarmScheduler) for r in range(2)]
    exchanges = _exchanges(tmp_path)
    sweeps = [make_sweep(points, exchange=exchanges[0]), make_sweep(points, exchange=exchanges[1], **rank_1_config)]
    for scheduler, sweep in zip(schedulers, sweeps):
        scheduler.kvwarm_sweep = sweep
    return schedulers, sweeps


def test_ranks_with_different_free_pools_plan_the_same_rung_from_the_smallest(tmp_path):
    # rank 1 has 40 blocks of 16 tokens free, rank 0 has 100: alone, rank 0 would keep
    # the rung's full depth; together both trim it to what rank 1's pool holds.
    schedulers = [
        make_scheduler(tmp_path / f"r{r}", num_blocks=n, scheduler_cls=KvWarmScheduler) for r, n in enumerate([100, 41])
    ]
    points = [DecodePoint(600, 2), DecodePoint(300, 2)]
    sweeps = [make_sweep(points, exchange=e) for e in _exchanges(tmp_path)]
    alone = make_sweep(points)
    schedulers[0].kvwarm_sweep, schedulers[1].kvwarm_sweep = sweeps
    _step_all(schedulers)
    assert all(s.done and s.reset_prefix_cache_ok for s in sweeps)
    assert sweeps[0].stages[0]["depth"] == sweeps[1].stages[0]["depth"] < alone.rungs[0].depth
    rows = [[(r.total_kv_read_tokens, r.kv_seed_regime) for r in s.rows] for s in sweeps]
    assert rows[0] == rows[1] == [(300, "real_kv"), (600, "fake_fallback")]
    for scheduler in schedulers:
        assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_a_plan_mismatch_stops_every_rank_with_both_digests_and_no_hang(tmp_path):
    # rank 1 was started with another repeat count: its plan (and its rows) would differ
    schedulers, sweeps = _two_ranks(tmp_path, [DecodePoint(200, 2)], steady_steps=5)
    errors = []
    for sweep in sweeps:
        _stop_on_rank_failure(sweep, errors)
    _step_all(schedulers, limit=50)
    digests = [sweep.plan_digest(sweep._rung) for sweep in sweeps]
    assert len(errors) == 2 and errors[0] == errors[1]
    assert "plan mismatch before rung batch=2" in errors[0] and all(d in errors[0] for d in digests)
    assert not any(sweep.rows for sweep in sweeps)
    for scheduler in schedulers:
        assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_a_rank_that_fails_stops_the_others_at_their_next_boundary(tmp_path):
    schedulers, sweeps = _two_ranks(tmp_path, [DecodePoint(200, 2), DecodePoint(100, 2), DecodePoint(50, 2)])
    errors = []
    _stop_on_rank_failure(sweeps[0], errors)

    def fail_rank_1_after_its_first_point(s, original=sweeps[1].before_schedule):
        if sweeps[1].rows:
            sweeps[1].abandon(s, "RuntimeError: rank 1 lost its worker")
            return
        original(s)

    sweeps[1].before_schedule = fail_rank_1_after_its_first_point
    _step_all(schedulers, limit=200)
    assert errors == ["rank 1 failed: RuntimeError: rank 1 lost its worker"]
    assert len(sweeps[0].rows) == 1  # measured together before rank 1 stopped
    for scheduler in schedulers:
        assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_a_rank_that_never_comes_is_given_up_on_after_the_timeout(tmp_path):
    now = [0.0]
    exchange = FileExchange(tmp_path / "out", "run", 2, 0, timeout=5.0, clock=lambda: now[0])
    exchange.post("pool", {"usable_blocks": 10})
    assert exchange.poll() is None
    now[0] = 6.0
    with pytest.raises(RankFailed, match=r"rank\(s\) \[1\] did not reach boundary 1 \(pool\) within 5 s"):
        exchange.poll()


def _rank_runs(tmp_path, monkeypatch, points, size=2):
    """SweepRuns configured as the adapter builds them, one per rank of a launch of `size`."""
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")  # fake KV: no dataset or tokenizer needed
    monkeypatch.setattr(ranks, "_launch_data_parallel_size", size)
    path = tmp_path / "points.json"
    path.write_text(
        json.dumps({"schema_version": 1, "decode": [{"total_kv_read_tokens": k, "batch_size": b} for k, b in points]})
    )
    out = tmp_path / "out"
    schedulers = []
    for rank in range(size):
        scheduler = make_scheduler(tmp_path / f"r{rank}", num_blocks=128, scheduler_cls=KvWarmScheduler)
        scheduler.vllm_config.parallel_config.data_parallel_index = rank
        scheduler.kvwarm_run = SweepRun(scheduler, {"points": str(path), "out": str(out)})
        scheduler.kvwarm_sweep = scheduler.kvwarm_run.sweep
        schedulers.append(scheduler)
    return schedulers, out


def test_each_rank_writes_its_own_folder_and_the_combined_view_says_complete_when_all_did(tmp_path, monkeypatch):
    points = [(400, 2), (300, 2), (200, 3), (100, 3)]
    schedulers, out = _rank_runs(tmp_path, monkeypatch, points)
    _step_all(schedulers)
    per_rank = [json.loads((out / f"dp{r}" / "sweep.json").read_text()) for r in range(2)]
    combined = json.loads((out / "sweep.json").read_text())
    for rank, artifact in enumerate(per_rank):
        validate(artifact)
        assert artifact["status"] == "complete" and artifact["artifact_type"] == "kvwarm.rank"
        assert artifact["layout"]["data_parallel_size"] == 2 and artifact["layout"]["data_parallel_rank"] == rank
        assert [r["global_batch_size"] for r in artifact["results"]] == [6, 6, 4, 4]
        assert artifact["finished_at"] >= artifact["started_at"]
    validate(combined)
    assert combined["artifact_type"] == "kvwarm.combined" and combined["status"] == "complete"
    assert [(r["rank"], r["status"], r["rows"]) for r in combined["ranks"]] == [(0, "complete", 4), (1, "complete", 4)]
    for row in combined["results"]:
        medians = {r["rank"]: r["median_seconds"] for r in row["ranks"]}
        assert row["median_seconds"] == max(medians.values())
        key = (row["point"]["total_kv_read_tokens"], row["point"]["batch_size"])
        assert medians == {
            rank: next(
                r["median_seconds"]
                for r in per_rank[rank]["results"]
                if (r["point"]["total_kv_read_tokens"], r["point"]["batch_size"]) == key
            )
            for rank in range(2)
        }
    assert not (out / ".kvwarm-sync").exists()  # the exchange's files go once every rank is done


def test_the_combined_view_names_the_rank_that_failed(tmp_path, monkeypatch):
    schedulers, out = _rank_runs(tmp_path, monkeypatch, [(400, 2), (300, 2), (200, 2)])
    rank_1 = schedulers[1].kvwarm_sweep
    start_point = rank_1._start_point

    def fail_the_second_point(*args):
        if rank_1.rows:
            raise RuntimeError("rank 1 lost its worker")
        return start_point(*args)

    rank_1._start_point = fail_the_second_point
    _step_all(schedulers)
    combined = json.loads((out / "sweep.json").read_text())
    assert combined["status"] == "failed"
    assert combined["error"].startswith("rank 0: RankFailed: rank 1 failed: RuntimeError: rank 1 lost its worker")
    assert "rank 1: RuntimeError: rank 1 lost its worker" in combined["error"]
    # rank 1 failed as it queued its second point; rank 0 measured that point and stopped at the next boundary
    assert [(r["rank"], r["status"], r["rows"]) for r in combined["ranks"]] == [(0, "failed", 2), (1, "failed", 1)]
    for scheduler in schedulers:
        assert in_use(scheduler.kv_cache_manager.block_pool) == {}


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
    from vllm.kvwarm.sweep.controller import END_WAIT_SECONDS

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
