"""Resuming a data-parallel sweep: two ranks' SweepRuns on real Schedulers stepped in one
process, meeting through the real exchanges, each rank with its own folder (through the store)
or one shared OUT (files). The first launch stops with rank 0 one row ahead of rank 1 (killed
between the two ranks' ends of a point); the resumed launch agrees on the points both
finished, measures the lone row's point again on both ranks, and the combined view holds every
point once."""

from __future__ import annotations

import json
import shutil

import pytest
from kvwarm_testing.rank_sweeps import EXCHANGES, artifacts, rank_runs, step_all, view
from kvwarm_testing.real_kv import step_scheduler
from vllm.kvwarm.record.row_log import read_log
from vllm.kvwarm.record.schema import validate
from vllm.kvwarm.sweep.exchange.files import SYNC_DIR

POINTS = [(400, 2), (300, 2), (200, 2), (100, 2)]


@pytest.fixture(autouse=True)
def _hashing():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def _stop_with_rank_0_ahead(schedulers) -> None:
    """Both ranks measure two points; rank 1 posts its start of the third and is gone; rank 0
    measures the third alone. Then nothing more runs (the exchanges closed, as by a kill)."""
    rank_0, rank_1 = (s.kvwarm_sweep for s in schedulers)
    for _ in range(2000):
        if len(rank_1.rows) >= 2:
            break
        for scheduler in schedulers:
            step_scheduler(scheduler)
    step_scheduler(schedulers[1])  # its record for the third point's meeting, and no more
    for _ in range(2000):
        if len(rank_0.rows) >= 3:
            break
        step_scheduler(schedulers[0])
    assert (len(rank_0.rows), len(rank_1.rows)) == (3, 2)
    for scheduler in schedulers:
        exchange = scheduler.kvwarm_run.writer.exchange
        if hasattr(exchange, "close"):  # the store's connections and threads
            exchange.close()


@pytest.mark.parametrize("kind", EXCHANGES)
def test_a_point_one_rank_finished_and_the_other_did_not_is_measured_again_on_both(tmp_path, monkeypatch, kind):
    schedulers, out = rank_runs(tmp_path, monkeypatch, POINTS, kind)
    _stop_with_rank_0_ahead(schedulers)
    shutil.rmtree(out / SYNC_DIR, ignore_errors=True)  # the files' records of the stopped launch: the command's part
    schedulers, out = rank_runs(tmp_path, monkeypatch, POINTS, kind, resume=True)
    step_all(schedulers)
    view(schedulers[0])
    per_rank, combined = artifacts(out, kind)
    keys = sorted((k, b) for k, b in POINTS)
    for rank, artifact in enumerate(per_rank):
        validate(artifact)
        assert artifact["status"] == "complete", artifact["error"]
        got = [(r["point"]["total_kv_read_tokens"], r["point"]["batch_size"]) for r in artifact["results"]]
        assert sorted(got) == keys  # every point once
        assert [(b["boot"], b["rows"]) for b in artifact["kvwarm"]["boots"]] == [(0, 2), (1, 2)]
    (replaced,) = per_rank[0]["kvwarm"]["resume"]["replaced"]
    assert replaced["point"]["total_kv_read_tokens"] == 200
    assert replaced["reason"].startswith("rank(s) [1] had not finished it")
    assert per_rank[1]["kvwarm"]["resume"]["replaced"] == []
    folder = out / "dp0"  # rank 0's own folder (through the store, its OUT is the view's)
    lines = [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines()]
    assert len([line for line in lines if line["kind"] == "row"]) == 5  # the lone row, and its replacement
    assert len(read_log(folder / "rows.jsonl").rows) == 4
    validate(combined)
    assert combined["status"] == "complete" and len(combined["results"]) == len(POINTS)
    assert [(r["rank"], r["status"], r["rows"]) for r in combined["ranks"]] == [(0, "complete", 4), (1, "complete", 4)]
