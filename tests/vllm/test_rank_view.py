"""Rank 0's combined view under the store exchange (real TCPStore on 127.0.0.1): kept as the rows
arrive, it writes what combine writes from the same artifacts; its thread reads and writes only
at rank 0's boundaries while rank 0's sweep runs; a failure to write it is logged and retried,
never the end of the exchange or the sweep; a change to rank 0's record is seen whatever the
record's identity."""

from __future__ import annotations

import json
import time

import pytest
from kvwarm_testing.rank_sweeps import settled, until
from vllm.kvwarm.record.artifact import KvwarmMeta, PointRow, build_artifact, results_csv
from vllm.kvwarm.record.combined import COMPACT, RunningView, combine
from vllm.kvwarm.sweep.exchange import view as view_module
from vllm.kvwarm.sweep.exchange.store import StoreExchange


def _artifact(rank: int, rows: list[PointRow], status: str = "running", size: int = 3, meta=None) -> dict:
    layout = {
        "data_parallel_size": size,
        "data_parallel_rank": rank,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "expert_parallel": False,
    }
    run = {"started_at": f"2026-12-07T00:00:0{rank}Z", "finished_at": None}
    return build_artifact(rows, meta or KvwarmMeta(), {"points": "p.json"}, status, run=run, layout=layout)


def _row(k: int, b: int, ms: float) -> PointRow:
    return PointRow(k, b, "legacy", samples=[ms / 1e3, 1.1 * ms / 1e3], median_seconds=1.05 * ms / 1e3)


def _skipped(k: int, b: int) -> PointRow:
    return PointRow(k, b, "skip:point_does_not_fit", detail="no room")


def test_the_running_view_writes_what_combine_writes_from_the_same_artifacts(tmp_path):
    """Three ranks whose rows arrive interleaved, in chunks, some points on one rank only (rank
    1 and 2 ahead of rank 0, a point rank 0 skipped), each write compared byte for byte."""
    rows = {
        0: [_row(10 * i, 1 + i % 3, 1.0 + i) for i in range(12)] + [_skipped(999, 2)],
        1: [_row(10 * i, 1 + i % 3, 2.0 + i) for i in range(15)],
        2: [_row(10 * i, 1 + i % 3, 1.5 + i) for i in (3, 1, 7, 14, 20)] + [_skipped(888, 1)],
    }
    running = RunningView(3)
    taken = {r: 0 for r in rows}
    for step, (rank, upto) in enumerate([(1, 4), (2, 3), (0, 2), (1, 9), (0, 7), (2, 6), (0, 13), (1, 15)]):
        artifact = _artifact(rank, rows[rank][:upto])
        results, skipped = artifact["results"], artifact["skipped_points"]
        old = [len(running.rows[rank][0]), len(running.rows[rank][1])]
        head = {k: x for k, x in artifact.items() if k not in ("results", "skipped_points")}
        running.take(rank, head, results[old[0] :], skipped[old[1] :])
        taken[rank] = upto
        lost = {2: "rank 0 gave up on it: test"} if step == 7 else None
        status = running.write(tmp_path / str(step), lost)
        whole = combine([_artifact(r, rows[r][: taken[r]]) if taken[r] else None for r in range(3)], lost)
        assert (tmp_path / str(step) / "sweep.json").read_text() == json.dumps(whole, separators=COMPACT)
        assert (tmp_path / str(step) / "sweep.csv").read_bytes() == results_csv(whole["results"])
        assert status == whole["status"]
    assert len(whole["skipped_points"]) == 2 and len(whole["results"]) == 16  # rank 1's 15 points, rank 2's K=200


def _pair(tmp_path, root=None):
    rank_0 = StoreExchange("127.0.0.1", 0, 2, 0, timeout=30.0, root=root or tmp_path / "out0")
    rank_1 = settled(StoreExchange("127.0.0.1", rank_0.port, 2, 1, timeout=30.0, root=tmp_path / "out1"))
    return rank_0, rank_1


def test_the_view_is_written_only_at_rank_0s_boundaries_while_its_sweep_runs(tmp_path, monkeypatch):
    """Rank 0 and rank 1 have written; while rank 0 posts no boundary (it times a point's steps)
    nothing is read or written for three collection periods; its next boundary lets the view
    write at once."""
    monkeypatch.setattr(view_module, "BOUNDARY_SECONDS", 600.0)
    rank_0, rank_1 = _pair(tmp_path)
    rank_1.share(_artifact(1, [_row(10, 1, 2.0)], size=2))
    rank_0.view.update(_artifact(0, [_row(10, 1, 1.0)], size=2))
    time.sleep(3 * view_module.COLLECT_SECONDS)  # what must not happen: polled for, it never comes
    assert not (tmp_path / "out0" / "sweep.json").exists() and not rank_0.view.heads
    rank_0.post("point", {"index": 0, "restage": False})  # a boundary: the view's turn
    path = tmp_path / "out0" / "sweep.json"
    until(lambda: path.exists() and json.loads(path.read_text())["ranks"][1]["rows"] == 1, "no view after a boundary")
    rank_0.close()
    rank_1.close()


def test_a_failed_write_of_the_view_keeps_the_exchange_and_is_written_again(tmp_path):
    """OUT is a file, not a folder, so the view cannot be written (as a full disk or a lost
    mount): the failure is logged, rank 0 still meets rank 1, and once OUT can be written the
    view is there, final, and the exchange closes."""
    blocked = tmp_path / "out0"
    blocked.write_text("not a folder")
    rank_0, rank_1 = _pair(tmp_path, root=blocked)
    rank_0.view.update(_artifact(0, [_row(10, 1, 1.0)], size=2))

    def failed() -> str | None:
        rank_0.view.between_points()  # rank 0's boundaries, one per point
        return rank_0.view._failure

    assert "FileExistsError" in until(failed, "the view's write did not fail")
    for exchange in (rank_0, rank_1):
        exchange.post("pool", {"usable_blocks": 3, "failed": None})
    assert [r["usable_blocks"] for r in until(rank_0.poll, "rank 0 did not meet")] == [3, 3]
    until(rank_1.poll, "rank 1 did not meet")
    assert rank_0.unheard() is None  # the exchange is open
    blocked.unlink()
    rank_1.share(_artifact(1, [_row(10, 1, 2.0)], "complete", size=2))
    rank_0.view.update(_artifact(0, [_row(10, 1, 1.0)], "complete", size=2))
    rank_0.view.collector.join(timeout=30)
    combined = json.loads((blocked / "sweep.json").read_text())
    assert combined["status"] == "complete" and combined["results"][0]["median_seconds"] == pytest.approx(2.1e-3)
    assert rank_0.view._failure is None and rank_0.unheard() == "the rank exchange is closed"
    rank_1.close()


def test_a_change_to_rank_0s_record_is_written_whatever_the_records_identity(tmp_path):
    """The same dict handed over again with a row more (an address the last one had: what
    made the view stale when "nothing changed" was told by id())."""
    rank_0, rank_1 = _pair(tmp_path)
    own = _artifact(0, [_row(10, 1, 1.0)], size=2)
    path = tmp_path / "out0" / "sweep.json"

    def rows_written() -> int:
        rank_0.view.between_points()
        return path.exists() and json.loads(path.read_text())["ranks"][0]["rows"]

    rank_0.view.update(own)
    until(lambda: rows_written() == 1, "no first view")
    own["results"].append(_artifact(0, [_row(20, 1, 1.0)], size=2)["results"][0])
    rank_0.view.update(own)
    until(lambda: rows_written() == 2, "the view stayed stale")
    rank_0.close()
    rank_1.close()


def test_an_ab_sweeps_running_view_writes_both_sides_as_combine_does(tmp_path):
    """Two ranks of an A/B sweep: each point's real row and its fake one (legacy, faster) arrive
    in chunks; every write of the running view is combine's, the fake side in its own block and
    the CSV holding both sides' rows."""

    def sides(rank: int, n: int) -> list[PointRow]:
        rows = []
        for i in range(n):
            real, fake = _row(10 * i, 1 + i % 2, 2.0 + i + rank), _row(10 * i, 1 + i % 2, 1.0 + i + rank)
            real.ab, fake.ab = "real", "fake"
            rows += [real, fake] if i % 2 else [fake, real]
        return rows

    def artifact(rank: int, rows: list[PointRow]) -> dict:
        return _artifact(rank, rows, size=2, meta=KvwarmMeta(ab={"first": "alternate"}))

    rows = {0: sides(0, 6), 1: sides(1, 5)}
    running, taken = RunningView(2), {0: 0, 1: 0}
    for step, (rank, upto) in enumerate([(1, 3), (0, 4), (1, 10), (0, 12)]):
        new = rows[rank][taken[rank] : upto]
        built = artifact(rank, rows[rank][:upto])
        head = {k: x for k, x in built.items() if k not in ("results", "skipped_points", "ab_fake_side")}
        chunk = artifact(rank, new)
        running.take(rank, head, chunk["results"] + chunk["ab_fake_side"]["results"], [])
        taken[rank] = upto
        running.write(tmp_path / str(step))
        whole = combine([artifact(r, rows[r][: taken[r]]) if taken[r] else None for r in range(2)])
        assert (tmp_path / str(step) / "sweep.json").read_text() == json.dumps(whole, separators=COMPACT)
        both = whole["results"] + whole["ab_fake_side"]["results"]
        assert (tmp_path / str(step) / "sweep.csv").read_bytes() == results_csv(both)
    assert len(whole["results"]) == 6 and len(whole["ab_fake_side"]["results"]) == 6
    assert {r["ab"] for r in whole["ab_fake_side"]["results"]} == {"fake"}
