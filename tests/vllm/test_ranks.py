"""One sweep over several data-parallel ranks, on real Schedulers: two ranks stepped in turn in
one process (the model runner's part played by the test), meeting through the real exchanges
(torch's TCPStore on 127.0.0.1, the default, and the file fallback), with per-rank artifacts
and the combined view on rank 0's side; outside requests kept out of the timed steps."""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import time
from pathlib import Path

import pytest
from kvwarm_testing.real_kv import in_use, make_request, make_scheduler, step_scheduler
from test_sweep import make_sweep
from vllm.kvwarm.record.schema import validate
from vllm.kvwarm.scheduler import KvWarmScheduler
from vllm.kvwarm.sweep import provenance
from vllm.kvwarm.sweep.exchange import make_exchange
from vllm.kvwarm.sweep.exchange.files import FileExchange
from vllm.kvwarm.sweep.exchange.solo import SoloExchange
from vllm.kvwarm.sweep.exchange.store import PORT_OFFSET, StoreExchange, store_address
from vllm.kvwarm.sweep.points import DecodePoint, PrefillPoint
from vllm.kvwarm.sweep.ranks import RankFailed
from vllm.kvwarm.sweep.run import SweepRun
from vllm.kvwarm.sweep.settings import SettingsError, read_settings

EXCHANGES = ("store", "files")


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


def _handed_over(scheduler, seconds: float = 30) -> None:
    """Wait for a rank's courier (which publishes off the step) to take what the rank handed
    it, and a moment more for the store to hold it: a test that then stops stepping the rank
    must not race its last publication."""
    courier = scheduler.kvwarm_run.writer.exchange
    deadline = time.monotonic() + seconds
    while courier._outbox and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _joined(exchange: StoreExchange, seconds: float = 30.0) -> StoreExchange:
    """A client once its connection (made in its own thread) is up or has failed."""
    deadline = time.monotonic() + seconds
    while exchange._store is None and exchange._error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return exchange


def _met(exchange, seconds: float = 30.0) -> list[dict]:
    """Every rank's records of the open boundary, polled as the sweep polls (a store's writes
    from another connection arrive a moment later)."""
    deadline = time.monotonic() + seconds
    while (records := exchange.poll()) is None:
        assert time.monotonic() < deadline, "the ranks did not meet"
        time.sleep(0.01)
    return records


def _exchanges(tmp_path, kind="store", size=2, timeout=60.0, clock=time.monotonic, start_timeout=None):
    """Every rank's exchange of one launch: the store on a free port of 127.0.0.1 (each rank's
    combined-view folder its own), or the files in one shared folder."""
    bounds = {"timeout": timeout, "start_timeout": start_timeout}
    if kind == "files":
        return [FileExchange(tmp_path / "out", "run", size, r, clock=clock, **bounds) for r in range(size)]
    port = free_port()
    made = [
        StoreExchange("127.0.0.1", port, size, r, root=tmp_path / f"out{r}", clock=clock, **bounds) for r in range(size)
    ]
    return [_joined(e) for e in made]


def _two_ranks(tmp_path, points, kind="store", **rank_1_config):
    """Two real schedulers, each with its sweep over `points` meeting the other's through the
    exchange `kind`; rank 1's sweep may be configured differently."""
    schedulers = [make_scheduler(tmp_path / f"r{r}", num_blocks=128, scheduler_cls=KvWarmScheduler) for r in range(2)]
    exchanges = _exchanges(tmp_path, kind)
    sweeps = [make_sweep(points, exchange=exchanges[0]), make_sweep(points, exchange=exchanges[1], **rank_1_config)]
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
    sweeps = [make_sweep(points, exchange=e) for e in _exchanges(tmp_path, kind)]
    alone = make_sweep(points)
    schedulers[0].kvwarm_sweep, schedulers[1].kvwarm_sweep = sweeps
    _step_all(schedulers)
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


@pytest.mark.parametrize("kind", EXCHANGES)
def test_a_rank_that_fails_stops_the_others_at_their_next_boundary(tmp_path, kind):
    schedulers, sweeps = _two_ranks(tmp_path, [DecodePoint(200, 2), DecodePoint(100, 2), DecodePoint(50, 2)], kind)
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


@pytest.mark.parametrize("kind", EXCHANGES)
def test_a_rank_that_never_comes_is_given_up_on_after_the_timeout(tmp_path, kind):
    now = [0.0]
    rank_0, rank_1 = _exchanges(tmp_path, kind, timeout=5.0, clock=lambda: now[0], start_timeout=50.0)
    rank_0.post("pool", {"usable_blocks": 10})
    now[0] = 30.0  # the first boundary waits for the ranks to start: longer than the timeout
    assert rank_0.poll() is None
    rank_1.post("pool", {"usable_blocks": 10})  # rank 1 comes to boundary 1 ...
    assert len(_met(rank_0)) == 2
    rank_0.post("plan", {"digest": "d"})  # ... but never to boundary 2
    assert rank_0.poll() is None
    now[0] = 36.0
    with pytest.raises(RankFailed, match=r"rank\(s\) \[1\] did not reach boundary 2 \(plan\) within 5 s"):
        rank_0.poll()
    if kind == "store":  # what rank 0's combined view will say of rank 1
        assert rank_0.lost == {1: "rank(s) [1] did not reach boundary 2 (plan) within 5 s"}


def _rank_runs(
    tmp_path, monkeypatch, points, kind="store", size=2, timeout=None, start=None, port=None, grid=None, blocks=None
):
    """SweepRuns configured as the adapter builds them, one per rank of a launch of `size`
    (`start`: those ranks only). Through the store each rank has an OUT of its own (as on
    nodes with their own disks: kvwarm_testing.plugin.rank_out); through files they share one.
    `grid`: a --grid sweep with these caps instead of `points`; `blocks`: each rank's pool."""
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")  # fake KV: no dataset or tokenizer needed
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP_RANK_SYNC", kind)
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT", str(port or free_port()))
    if timeout is not None:
        monkeypatch.setenv("DYN_BENCH_KV_WARMUP_RANK_TIMEOUT", str(timeout))
    monkeypatch.setattr(provenance, "_launch_data_parallel_size", size)
    path = tmp_path / "points.json"
    path.write_text(
        json.dumps({"schema_version": 1, "decode": [{"total_kv_read_tokens": k, "batch_size": b} for k, b in points]})
    )
    out = tmp_path / "out"
    schedulers = []
    for rank in range(size) if start is None else start:
        pool = blocks[rank] if blocks else 128
        scheduler = make_scheduler(tmp_path / f"r{rank}", num_blocks=pool, scheduler_cls=KvWarmScheduler)
        scheduler.vllm_config.parallel_config.data_parallel_index = rank
        rank_out = out if kind == "files" else _rank_out(out, rank)
        spec = {"grid": grid} if grid else {"points": str(path)}
        scheduler.kvwarm_run = SweepRun(scheduler, {**spec, "out": str(rank_out)})
        scheduler.kvwarm_sweep = scheduler.kvwarm_run.sweep
        schedulers.append(scheduler)
    for scheduler in schedulers:
        if isinstance(scheduler.kvwarm_run.writer.exchange, StoreExchange):
            _joined(scheduler.kvwarm_run.writer.exchange)
    return schedulers, out


def _rank_out(out, rank):
    from kvwarm_testing.plugin import rank_out

    return rank_out(out, rank)


def _artifacts(out, kind, size=2):
    """Every rank's own artifact, each from its own OUT, and the combined view (rank 0's OUT)."""
    folders = [out if kind == "files" else _rank_out(out, r) for r in range(size)]
    per_rank = [json.loads((folder / f"dp{r}" / "sweep.json").read_text()) for r, folder in enumerate(folders)]
    return per_rank, json.loads((out / "sweep.json").read_text())


def _view(scheduler) -> dict:
    """Rank 0's combined view once its collector (if one runs) is done."""
    exchange = scheduler.kvwarm_run.writer.exchange
    if isinstance(exchange, StoreExchange) and exchange.view.collector is not None:
        exchange.view.collector.join(timeout=60)
        assert not exchange.view.collector.is_alive(), "rank 0's combined view never became final"
    return json.loads((Path(scheduler.kvwarm_run.writer.root) / "sweep.json").read_text())


@pytest.mark.parametrize("kind", EXCHANGES)
def test_each_rank_writes_its_own_folder_and_the_combined_view_says_complete_when_all_did(tmp_path, monkeypatch, kind):
    points = [(400, 2), (300, 2), (200, 3), (100, 3)]
    schedulers, out = _rank_runs(tmp_path, monkeypatch, points, kind)
    _step_all(schedulers)
    _view(schedulers[0])
    per_rank, combined = _artifacts(out, kind)
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
    # every field of every rank's rows reaches the combined view, whatever the rows carry
    for row in combined["results"]:
        mine = next(r for r in per_rank[0]["results"] if r["point"] == row["point"])
        assert set(mine) <= set(row) and all(row[f] == mine[f] for f in mine if f not in MERGED)
    assert not (out / ".kvwarm-sync").exists()  # the file exchange's records go once every rank is done
    if kind == "store":  # nothing of the exchange was written to any folder
        assert sorted(p.name for p in out.iterdir()) == ["dp0", "sweep.csv", "sweep.json"]
        assert sorted(p.name for p in _rank_out(out, 1).iterdir()) == ["dp1"]


# The fields the combined view merges across ranks (the rest is rank 0's row as it is).
MERGED = {"median_seconds", "min_seconds", "max_seconds", "spread", "ranks"}


@pytest.mark.parametrize("kind", EXCHANGES)
def test_the_combined_view_names_the_rank_that_failed(tmp_path, monkeypatch, kind):
    schedulers, _ = _rank_runs(tmp_path, monkeypatch, [(400, 2), (300, 2), (200, 2)], kind)
    rank_1 = schedulers[1].kvwarm_sweep
    start_point = rank_1._start_point

    def fail_the_second_point(*args):
        if rank_1.rows:
            raise RuntimeError("rank 1 lost its worker")
        return start_point(*args)

    rank_1._start_point = fail_the_second_point
    _step_all(schedulers)
    combined = _view(schedulers[0])
    assert combined["status"] == "failed"
    assert combined["error"].startswith("rank 0: RankFailed: rank 1 failed: RuntimeError: rank 1 lost its worker")
    assert "rank 1: RuntimeError: rank 1 lost its worker" in combined["error"]
    # rank 1 failed as it queued its second point; rank 0 measured that point and stopped at the next boundary
    assert [(r["rank"], r["status"], r["rows"]) for r in combined["ranks"]] == [(0, "failed", 2), (1, "failed", 1)]
    for scheduler in schedulers:
        assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_rank_0_ending_first_keeps_gathering_until_the_combined_view_is_final(tmp_path, monkeypatch):
    schedulers, out = _rank_runs(tmp_path, monkeypatch, [(300, 2), (200, 2), (100, 2)])
    rank_0, rank_1 = (s.kvwarm_sweep for s in schedulers)
    while not rank_0.done:  # rank 1 stops once it has measured its last point: its end comes later
        step_scheduler(schedulers[0])
        if len(rank_1.rows) < 3:
            step_scheduler(schedulers[1])
    assert not rank_1.done
    view = schedulers[0].kvwarm_run.writer.exchange.view
    assert view.collector.is_alive() and json.loads((out / "sweep.json").read_text())["status"] == "running"
    _step_all(schedulers)
    combined = _view(schedulers[0])
    assert combined["status"] == "complete"
    assert [(r["rank"], r["status"], r["rows"]) for r in combined["ranks"]] == [(0, "complete", 3), (1, "complete", 3)]
    with pytest.raises(RankFailed, match="closed"):  # the store is gone once the view is final
        schedulers[0].kvwarm_run.writer.exchange.post("pool", {})


def test_a_rank_that_stops_mid_sweep_fails_the_others_and_the_view_names_it(tmp_path, monkeypatch):
    """What a kill -9 of rank 1 looks like to rank 0: rank 1 stops stepping (and talking)
    after its second point; rank 0 gives up on it at its next boundary, after the timeout.
    Dynamo's files, asked for, are written for both ranks: rank 1's as failed, with why."""
    dynamo = tmp_path / "dynamo" / "benchmark.json"
    monkeypatch.setenv("DYN_FPM_BENCHMARK_OUTPUT_PATH", str(dynamo))
    # 3 s: rank 0 must not give up on rank 1 while rank 1 still steps (one thread steps both,
    # and on a loaded host a step of rank 1 once took over the 1 s this test had)
    schedulers, out = _rank_runs(tmp_path, monkeypatch, [(400, 2), (300, 2), (200, 2), (100, 2)], timeout=3)
    rank_1 = schedulers[1].kvwarm_sweep
    started = None
    for _ in range(20000):
        if not schedulers[0].has_requests():
            break
        step_scheduler(schedulers[0])
        if len(rank_1.rows) < 2:
            step_scheduler(schedulers[1])
            if len(rank_1.rows) == 2:
                _handed_over(schedulers[1])
        elif started is None:
            started = time.monotonic()
    assert started is not None, "rank 0 stopped before rank 1 measured its second point"
    seconds = time.monotonic() - started
    combined = _view(schedulers[0])
    own = json.loads((out / "dp0" / "sweep.json").read_text())
    assert own["status"] == "failed" and re.search(
        r"rank\(s\) \[1\] did not reach boundary .* within 3 s", own["error"]
    )
    assert len(own["results"]) == 2  # every point measured before rank 1 went silent
    # rank 0 may have waited at the boundary before rank 1 went silent: the timeout it kept
    # is in the error below ("within 3 s"), and this bound says it did not wait for ever
    assert seconds < 30
    assert combined["status"] == "failed" and combined["ranks"][1]["status"] == "failed"
    assert combined["ranks"][1]["error"].startswith("rank 0 gave up on it: rank(s) [1] did not reach boundary")
    assert combined["ranks"][1]["rows"] == 2  # its last record, as published
    files = [json.loads(p.read_text()) for p in (dynamo, dynamo.with_name("benchmark_dp1.json"))]
    assert [f["status"] for f in files] == ["failed", "failed"]  # rank 0's own record failed too
    assert files[1]["error"] == combined["ranks"][1]["error"]


def test_a_rank_that_never_starts_leaves_a_final_view_naming_it(tmp_path, monkeypatch):
    # the ranks' start is waited for as long as the rank timeout says (no start timeout set)
    schedulers, _ = _rank_runs(tmp_path, monkeypatch, [(300, 2)], timeout=1, start=[0])
    _step_all(schedulers, limit=100000)
    combined = _view(schedulers[0])
    assert combined["status"] == "failed"
    assert combined["ranks"][1] == {
        "rank": 1,
        "status": "failed",
        "rows": 0,
        "path": "dp1/sweep.json",
        "error": "rank 0 gave up on it: rank(s) [1] did not reach boundary 1 (pool) within 1 s",
    }


def test_rank_0_gives_up_on_a_rank_silent_after_its_own_end(tmp_path, monkeypatch):
    schedulers, _ = _rank_runs(tmp_path, monkeypatch, [(300, 2), (200, 2)], timeout=1)
    rank_0, rank_1 = (s.kvwarm_sweep for s in schedulers)
    while not rank_0.done:
        step_scheduler(schedulers[0])
        if len(rank_1.rows) < 2:
            step_scheduler(schedulers[1])
            if len(rank_1.rows) == 2:
                _handed_over(schedulers[1])
    assert not rank_1.done  # and never will be: it is not stepped again after its last point
    combined = _view(schedulers[0])
    assert combined["status"] == "failed" and combined["ranks"][0]["status"] == "complete"
    assert combined["ranks"][1]["error"].startswith(
        "rank 0 gave up on it: nothing new from it for 1 s after rank 0's own end (its last record: running, 2 row(s))"
    )


def test_a_rank_that_cannot_reach_the_store_fails_naming_the_address_the_port_and_the_settings(tmp_path):
    port = free_port()  # nothing listens there
    exchange = StoreExchange(
        "127.0.0.1", port, 2, 1, timeout=1.0, start_timeout=1.0, root=tmp_path, origin="set by test"
    )
    exchange.post("pool", {"usable_blocks": 1})  # while it still tries: kept for when it is in
    assert exchange.poll() is None
    with pytest.raises(RankFailed) as failed:
        while exchange.poll() is None:  # a connection refused: it tries again until the timeout
            time.sleep(0.05)
    message = str(failed.value)
    assert message.startswith(
        f"rank 1 could not reach the rank exchange (torch TCPStore) that rank 0 hosts at "
        f"127.0.0.1:{port} (port set by test) within 1 s (while the ranks start: "
        "DYN_BENCH_KV_WARMUP_RANK_START_TIMEOUT, default DYN_BENCH_KV_WARMUP_RANK_TIMEOUT)"
    )
    assert "DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT" in message and "DYN_BENCH_KV_WARMUP_RANK_SYNC=files" in message
    exchange.post_failure("RankFailed: ...")  # never raises


def test_a_rank_0_that_cannot_host_fails_its_sweep_and_the_engine_serves_on(tmp_path, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (scheduler,), out = _rank_runs(tmp_path, monkeypatch, [(300, 2)], start=[0], port=port)
        step_scheduler(scheduler)  # the first boundary: the sweep fails, the engine does not
    own = json.loads((out / "dp0" / "sweep.json").read_text())
    assert own["status"] == "failed"
    assert own["error"].startswith(
        f"RankFailed: rank 0 could not host the rank exchange (torch TCPStore) at "
        f"127.0.0.1:{port} (port set by DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT): "
    )
    assert "EADDRINUSE" in own["error"] or "in use" in own["error"]
    assert "DYN_BENCH_KV_WARMUP_RANK_SYNC=files" in own["error"]
    scheduler.add_request(make_request("user-after", 20))
    for _ in range(40):
        if not scheduler.has_requests():
            break
        step_scheduler(scheduler)
    assert "user-after" not in scheduler.requests  # served to its end
    rank_1 = _view(scheduler)["ranks"][1]  # rank 0 cannot hear from it: final at once
    assert rank_1["status"] == "failed" and rank_1["error"].startswith("rank 0 cannot hear from it (it sent no record)")


def test_a_rank_that_connects_late_posts_as_soon_as_it_is_in(tmp_path):
    """Rank 1 starts before rank 0 hosts the store: its posts wait in it until it is in."""
    port = free_port()
    rank_1 = StoreExchange("127.0.0.1", port, 2, 1, timeout=30.0, root=tmp_path / "out1")
    rank_1.post("pool", {"usable_blocks": 7})
    assert rank_1.poll() is None
    time.sleep(0.6)  # a few refused attempts
    rank_0 = StoreExchange("127.0.0.1", port, 2, 0, timeout=30.0, root=tmp_path / "out0")
    rank_0.post("pool", {"usable_blocks": 9})
    assert [(r["rank"], r["usable_blocks"]) for r in _met(rank_0)] == [(0, 9), (1, 7)]
    assert [(r["rank"], r["usable_blocks"]) for r in _met(rank_1)] == [(0, 9), (1, 7)]


def test_a_second_launch_on_the_same_port_is_refused_not_mixed_in(tmp_path):
    port = free_port()
    first = [_joined(StoreExchange("127.0.0.1", port, 2, r, root=tmp_path / f"a{r}")) for r in range(2)]
    intruder = _joined(StoreExchange("127.0.0.1", port, 2, 1, root=tmp_path / "b1"))
    with pytest.raises(RankFailed, match="rank 1 of another launch already joined the rank exchange at 127.0.0.1"):
        intruder.post("pool", {"usable_blocks": 1})
    for exchange in first:
        exchange.post("pool", {"usable_blocks": 2})
    assert [[r["usable_blocks"] for r in _met(e)] for e in first] == [[2, 2], [2, 2]]


def test_the_store_listens_beside_vllms_dp_master_port_or_where_the_setting_says(tmp_path):
    from vllm.config import ParallelConfig

    parallel = ParallelConfig()
    master = parallel.data_parallel_master_port
    assert store_address(parallel) == (
        parallel.data_parallel_master_ip,
        master + PORT_OFFSET,
        f"vLLM's DP master port {master} + 10",
    )
    assert store_address(parallel, 4242) == (
        parallel.data_parallel_master_ip,
        4242,
        "set by DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT",
    )
    parallel.data_parallel_master_port = 65530
    assert store_address(parallel)[1] == 65520
    layout = provenance.RankLayout(2, 1, 1, 1, False)
    files = make_exchange(layout, tmp_path, parallel, read_settings({"DYN_BENCH_KV_WARMUP_RANK_SYNC": "files"}))
    assert isinstance(files, FileExchange) and files.folder.parent.name == ".kvwarm-sync"
    assert isinstance(
        make_exchange(provenance.RankLayout(1, 0, 1, 1, False), tmp_path, parallel, read_settings({})), SoloExchange
    )


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"DYN_BENCH_KV_WARMUP_RANK_SYNC": "nfs"},
            "DYN_BENCH_KV_WARMUP_RANK_SYNC='nfs' is not one of store, files (default store)",
        ),
        (
            {"DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT": "http"},
            "DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT='http' is not a TCP port number (1 to 65535)",
        ),
        (
            {"DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT": "70000"},
            "DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT='70000' is out of range: a TCP port is 1 to 65535",
        ),
        (
            {"DYN_BENCH_KV_WARMUP_RANK_TIMEOUT": "0"},
            "DYN_BENCH_KV_WARMUP_RANK_TIMEOUT='0' is out of range: it must be an integer >= 1 (default 300)",
        ),
        (
            {"DYN_BENCH_KV_WARMUP_RANK_START_TIMEOUT": "soon"},
            (
                "DYN_BENCH_KV_WARMUP_RANK_START_TIMEOUT='soon' is not an integer "
                "(default DYN_BENCH_KV_WARMUP_RANK_TIMEOUT's value)"
            ),
        ),
    ],
)
def test_the_rank_settings_refuse_what_they_do_not_know_naming_the_variable(env, message):
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_settings(env)
    settings = read_settings(
        {
            "DYN_BENCH_KV_WARMUP_RANK_SYNC": " FILES ",
            "DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT": "4242",
            "DYN_BENCH_KV_WARMUP_RANK_TIMEOUT": "20",
        }
    )
    assert (settings.rank_sync, settings.rank_sync_port, settings.rank_timeout) == ("files", 4242, 20)
    assert (read_settings({}).rank_sync, read_settings({}).rank_timeout) == ("store", 300)
    assert read_settings({"DYN_BENCH_KV_WARMUP_RANK_TIMEOUT": "20"}).start_timeout == 20  # the rank timeout's
    assert read_settings({"DYN_BENCH_KV_WARMUP_RANK_START_TIMEOUT": "900"}).start_timeout == 900


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


# --- one grid on every rank (a --grid sweep under data parallel) -------------------------------
GRID_CAPS = {"decode_batches": 3, "kv_ladder": 2, "prefill_tokens": 2}


@pytest.mark.parametrize("kind", EXCHANGES)
def test_a_grid_sweep_lays_one_grid_in_the_smallest_pool_on_ranks_whose_pools_differ(tmp_path, monkeypatch, kind):
    """Rank 1's pool is smaller: alone, each rank would lay another grid (its deepest decode
    points follow the pool); together they lay one, in rank 1's pool, and rank 0 writes it."""
    from vllm.kvwarm.sweep.grid import CAPS, GridLimits, decode_grid
    from vllm.kvwarm.sweep.meetings import pool_record

    blocks = [160, 120]
    hook = tmp_path / "hook" / "benchmark.json"  # Dynamo's own path: written by the rank holding every record
    monkeypatch.setenv("DYN_FPM_BENCHMARK_OUTPUT_PATH", str(hook))
    schedulers, out = _rank_runs(tmp_path, monkeypatch, [], kind, grid=GRID_CAPS, blocks=blocks)
    pools = [pool_record(s) for s in schedulers]
    alone = []
    for scheduler, pool in zip(schedulers, pools):  # what each rank would lay in its own pool
        graphs = scheduler.kvwarm_sweep._graphs
        limits = GridLimits(1024, 3, pool["kv_cache_tokens"], pool["num_blocks"], 16, 16)
        alone.append(decode_grid(graphs, limits, {**CAPS, **GRID_CAPS}))
    assert alone[0] != alone[1]
    _step_all(schedulers, limit=20000)
    _view(schedulers[0])
    per_rank, combined = _artifacts(out, kind)
    grids = [dict(a["kvwarm"]["grid"]) for a in per_rank]
    for rank, grid in enumerate(grids):  # each names OUT/grid.json as its OUT is named (rank 0 writes it)
        assert grid.pop("points_file") == str((out if kind == "files" else _rank_out(out, rank)) / "grid.json")
    assert grids[0] == grids[1] and grids[0]["pool"] == {k: min(p[k] for p in pools) for k in pools[0]}
    assert grids[0]["pool"]["num_blocks"] == 120 and grids[0]["prefill_tokens"] and grids[0]["decode_batches"]
    rows = [sorted(json.dumps(r["point"], sort_keys=True) for r in a["results"]) for a in per_rank]
    assert rows[0] == rows[1] and len(rows[0]) == grids[0]["points"]  # every point measured on both ranks
    assert {r["point"]["point_type"] for r in per_rank[0]["results"]} == {"decode", "prefill", "mixed"}
    written = json.loads((out / "grid.json").read_text())  # rank 0's, the one grid
    assert len(written["decode"]) + len(written["prefill"]) + len(written["mixed"]) == grids[0]["points"]
    if kind == "store":  # rank 1's own OUT holds its artifact alone
        assert sorted(p.name for p in _rank_out(out, 1).iterdir()) == ["dp1"]
    assert combined["status"] == "complete"
    assert [(r["rank"], r["status"], r["rows"]) for r in combined["ranks"]] == [
        (0, "complete", grids[0]["points"]),
        (1, "complete", grids[0]["points"]),
    ]
    # both kinds at Dynamo's path as its agg mode writes them, and each kind beside it, every rank's
    stems = ["benchmark", "benchmark_decode", "benchmark_prefill"]
    names = sorted(f"{stem}{suffix}.json" for stem in stems for suffix in ("", "_dp1"))
    assert sorted(p.name for p in hook.parent.iterdir()) == names
    agg = [json.loads((hook.parent / name).read_text()) for name in ("benchmark.json", "benchmark_dp1.json")]
    pure = grids[0]["points"] - len(written["mixed"])  # Dynamo's artifact has no mixed point type
    assert [(f["config"]["mode"], f["dp"]["rank"], len(f["results"])) for f in agg] == [
        ("agg", 0, pure),
        ("agg", 1, pure),
    ]
    port = agg[0]["synchronization"]["port"]
    assert port == (None if kind == "files" else int(os.environ["DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT"]))


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
    sweeps = [_prefill_sweep(points, e) for e in _exchanges(tmp_path)]
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
    sweeps = [_prefill_sweep(points, e) for e in _exchanges(tmp_path)]
    for scheduler, sweep in zip(schedulers, sweeps):
        scheduler.kvwarm_sweep = sweep
    _step_all(schedulers)
    assert [len(s.stages) for s in sweeps] == [2, 2]  # built, then built again, on both ranks
    assert [r.kv_seed_regime for r in sweeps[0].rows] == ["real_prefix", "not_applicable"]
    assert [r.kv_seed_regime for r in sweeps[1].rows] == ["skip:real_seed_cache_validation_failed", "not_applicable"]
    for scheduler in schedulers:
        assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_the_command_refuses_data_parallel_over_ray_where_the_platform_names_no_ray_device(
    tmp_path, capsys, monkeypatch, engine_cli
):
    """vLLM's Ray launcher places each rank on the Ray resource its platform names; the CPU
    platform names none (vLLM stops with an assertion before any engine core exists)."""
    from vllm.kvwarm.sweep.command import run
    from vllm.platforms import current_platform

    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    assert not current_platform.ray_device_key  # what this host's vLLM says: no GPU here
    points = tmp_path / "points.json"
    points.write_text(json.dumps({"schema_version": 1, "decode": [{"total_kv_read_tokens": 64, "batch_size": 1}]}))
    out = tmp_path / "out"
    argv = ["--points", str(points), "--out", str(out), "--model", str(tmp_path / "model")]
    assert run([*argv, "--data-parallel-size", "2", "--data-parallel-backend", "ray"]) == 2
    said = capsys.readouterr().err
    assert "--data-parallel-backend ray: vLLM's" in said and "platform names no Ray device" in said
    artifact = json.loads((out / "sweep.json").read_text())
    assert artifact["status"] == "failed" and "use --data-parallel-backend mp" in artifact["error"]
