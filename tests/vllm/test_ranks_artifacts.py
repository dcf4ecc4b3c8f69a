"""Two data-parallel ranks' SweepRuns, configured as the adapter builds them, on real Schedulers
stepped in turn in one process and meeting through the real exchanges: each rank's own
artifact (through the store, in an OUT of its own), the combined view on rank 0's side, and
what it says of a rank that failed, went silent, never started or outlasted rank 0; one --grid
laid in the smaller of two unequal pools, and Dynamo's files of every rank."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from kvwarm_testing.plugin import rank_out
from kvwarm_testing.rank_sweeps import EXCHANGES, artifacts, handed_over, rank_runs, step_all, view
from kvwarm_testing.real_kv import in_use, step_scheduler
from vllm.kvwarm.record.schema import validate
from vllm.kvwarm.sweep.ranks import RankFailed


@pytest.fixture(autouse=True)
def _hashing():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


@pytest.mark.parametrize("kind", EXCHANGES)
def test_each_rank_writes_its_own_folder_and_the_combined_view_says_complete_when_all_did(tmp_path, monkeypatch, kind):
    points = [(400, 2), (300, 2), (200, 3), (100, 3)]
    schedulers, out = rank_runs(tmp_path, monkeypatch, points, kind)
    step_all(schedulers)
    view(schedulers[0])
    per_rank, combined = artifacts(out, kind)
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
        assert sorted(p.name for p in rank_out(out, 1).iterdir()) == ["dp1"]


# The fields the combined view merges across ranks (the rest is rank 0's row as it is).


# The fields the combined view merges across ranks (the rest is rank 0's row as it is).
MERGED = {"median_seconds", "min_seconds", "max_seconds", "spread", "ranks"}


@pytest.mark.parametrize("kind", EXCHANGES)
def test_the_combined_view_names_the_rank_that_failed(tmp_path, monkeypatch, kind):
    schedulers, _ = rank_runs(tmp_path, monkeypatch, [(400, 2), (300, 2), (200, 2)], kind)
    exchange = schedulers[1].kvwarm_run.writer.exchange  # rank 1's
    poll = exchange.poll

    def fail_at_the_second_point(*args):
        """Rank 1 fails as its second point starts: once the ranks met at it."""
        records = poll(*args)
        if records and records[0]["kind"] == "point" and records[0]["index"] == 1:
            raise RuntimeError("rank 1 lost its worker")
        return records

    monkeypatch.setattr(exchange, "poll", fail_at_the_second_point)
    step_all(schedulers)
    combined = view(schedulers[0])
    assert combined["status"] == "failed"
    assert combined["error"].startswith("rank 0: RankFailed: rank 1 failed: RuntimeError: rank 1 lost its worker")
    assert "rank 1: RuntimeError: rank 1 lost its worker" in combined["error"]
    # rank 1 failed as it queued its second point; rank 0 measured that point and stopped at the next boundary
    assert [(r["rank"], r["status"], r["rows"]) for r in combined["ranks"]] == [(0, "failed", 2), (1, "failed", 1)]
    for scheduler in schedulers:
        assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_rank_0_ending_first_keeps_gathering_until_the_combined_view_is_final(tmp_path, monkeypatch):
    schedulers, out = rank_runs(tmp_path, monkeypatch, [(300, 2), (200, 2), (100, 2)])
    rank_0, rank_1 = (s.kvwarm_sweep for s in schedulers)
    while not rank_0.done:  # rank 1 stops once it has measured its last point: its end comes later
        step_scheduler(schedulers[0])
        if len(rank_1.rows) < 3:
            step_scheduler(schedulers[1])
    assert not rank_1.done
    collector = schedulers[0].kvwarm_run.writer.exchange.view.collector
    assert collector.is_alive() and json.loads((out / "sweep.json").read_text())["status"] == "running"
    step_all(schedulers)
    combined = view(schedulers[0])
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
    schedulers, out = rank_runs(tmp_path, monkeypatch, [(400, 2), (300, 2), (200, 2), (100, 2)], timeout=3)
    rank_1 = schedulers[1].kvwarm_sweep
    started = None
    for _ in range(20000):
        if not schedulers[0].has_requests():
            break
        step_scheduler(schedulers[0])
        if len(rank_1.rows) < 2:
            step_scheduler(schedulers[1])
            if len(rank_1.rows) == 2:
                handed_over(schedulers[1])
        elif started is None:
            started = time.monotonic()
    assert started is not None, "rank 0 stopped before rank 1 measured its second point"
    seconds = time.monotonic() - started
    combined = view(schedulers[0])
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
    schedulers, _ = rank_runs(tmp_path, monkeypatch, [(300, 2)], timeout=1, start=[0])
    step_all(schedulers, limit=100000)
    combined = view(schedulers[0])
    assert combined["status"] == "failed"
    assert combined["ranks"][1] == {
        "rank": 1,
        "status": "failed",
        "rows": 0,
        "path": "dp1/sweep.json",
        "error": "rank 0 gave up on it: rank(s) [1] did not reach boundary 1 (pool) within 1 s",
    }


def test_rank_0_gives_up_on_a_rank_silent_after_its_own_end(tmp_path, monkeypatch):
    schedulers, _ = rank_runs(tmp_path, monkeypatch, [(300, 2), (200, 2)], timeout=1)
    rank_0, rank_1 = (s.kvwarm_sweep for s in schedulers)
    while not rank_0.done:
        step_scheduler(schedulers[0])
        if len(rank_1.rows) < 2:
            step_scheduler(schedulers[1])
            if len(rank_1.rows) == 2:
                handed_over(schedulers[1])
    assert not rank_1.done  # and never will be: it is not stepped again after its last point
    combined = view(schedulers[0])
    assert combined["status"] == "failed" and combined["ranks"][0]["status"] == "complete"
    assert combined["ranks"][1]["error"].startswith(
        "rank 0 gave up on it: nothing new from it for 1 s after rank 0's own end (its last record: running, 2 row(s))"
    )


# --- one grid on every rank (a --grid sweep under data parallel) -------------------------------
GRID_CAPS = {"decode_batches": 3, "kv_ladder": 2, "prefill_tokens": 2}


@pytest.mark.parametrize("kind", EXCHANGES)
def test_a_grid_sweep_lays_one_grid_in_the_smallest_pool_on_ranks_whose_pools_differ(tmp_path, monkeypatch, kind):
    """Rank 1's pool is smaller: alone, each rank would lay another grid (its deepest decode
    points follow the pool); together they lay one, in rank 1's pool, and rank 0 writes it."""
    from vllm.kvwarm.sweep.graphs import graph_config
    from vllm.kvwarm.sweep.grid import CAPS, GridLimits, decode_grid
    from vllm.kvwarm.sweep.meetings import pool_record

    blocks = [160, 120]
    hook = tmp_path / "hook" / "benchmark.json"  # Dynamo's own path: written by the rank holding every record
    monkeypatch.setenv("DYN_FPM_BENCHMARK_OUTPUT_PATH", str(hook))
    schedulers, out = rank_runs(tmp_path, monkeypatch, [], kind, grid=GRID_CAPS, blocks=blocks)
    pools = [pool_record(s) for s in schedulers]
    alone = []
    for scheduler, pool in zip(schedulers, pools):  # what each rank would lay in its own pool
        graphs = graph_config(scheduler.vllm_config)  # what the sweep reads of the engine
        limits = GridLimits(1024, 3, pool["kv_cache_tokens"], pool["num_blocks"], 16, 16)
        alone.append(decode_grid(graphs, limits, {**CAPS, **GRID_CAPS}))
    assert alone[0] != alone[1]
    step_all(schedulers, limit=20000)
    view(schedulers[0])
    per_rank, combined = artifacts(out, kind)
    grids = [dict(a["kvwarm"]["grid"]) for a in per_rank]
    for rank, grid in enumerate(grids):  # each names OUT/grid.json as its OUT is named (rank 0 writes it)
        assert grid.pop("points_file") == str((out if kind == "files" else rank_out(out, rank)) / "grid.json")
    assert grids[0] == grids[1] and grids[0]["pool"] == {k: min(p[k] for p in pools) for k in pools[0]}
    assert grids[0]["pool"]["num_blocks"] == 120 and grids[0]["prefill_tokens"] and grids[0]["decode_batches"]
    rows = [sorted(json.dumps(r["point"], sort_keys=True) for r in a["results"]) for a in per_rank]
    assert rows[0] == rows[1] and len(rows[0]) == grids[0]["points"]  # every point measured on both ranks
    assert {r["point"]["point_type"] for r in per_rank[0]["results"]} == {"decode", "prefill", "mixed"}
    written = json.loads((out / "grid.json").read_text())  # rank 0's, the one grid
    assert len(written["decode"]) + len(written["prefill"]) + len(written["mixed"]) == grids[0]["points"]
    if kind == "store":  # rank 1's own OUT holds its artifact alone
        assert sorted(p.name for p in rank_out(out, 1).iterdir()) == ["dp1"]
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
