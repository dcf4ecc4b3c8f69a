"""Rows on disk as they are measured (rows.jsonl, record.row_log) and the artifact writer's
cost: a row's line is flushed before the paced sweep.json rewrite, a torn last line is left
out and cut off, the running sweep.json is compact and unchecked (the schema is checked at the
final write alone), the pacing counts the exchange's share, and the file exchange's combine
never waits for a lock another rank holds while it runs."""

from __future__ import annotations

import fcntl
import json
import time

import pytest
from vllm.kvwarm.record import vocabulary as v
from vllm.kvwarm.record.artifact import PointRow
from vllm.kvwarm.record.row_log import RowLog, cut_torn_tail, read_log
from vllm.kvwarm.sweep import writer as writer_module
from vllm.kvwarm.sweep.exchange.files import FileExchange
from vllm.kvwarm.sweep.writer import ArtifactWriter


def _row(k: int, ab: str | None = None) -> PointRow:
    return PointRow(k, 2, v.LEGACY, [], [0.01, 0.02, 0.015], 0.015, ab=ab)


def test_every_row_is_a_flushed_line_that_reads_back_as_the_row(tmp_path):
    log = RowLog(tmp_path, 0, "2026-12-09T10:00:00Z")
    log.row(_row(100), 0, 1, 3)
    log.stage({"batch": 2, "depth": 64, "build_seconds": 0.5})
    log.row(PointRow(200, 2, "skip:decode_injection_failed", detail="pool_exhausted"), 1, 2, 3)
    # read while the file is open, as a reader in another process would: nothing is buffered
    lines = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["boot", "row", "stage", "row"]
    assert lines[1]["done"] == 1 and lines[1]["planned"] == 3 and lines[1]["at"] > 0
    logged = read_log(tmp_path / "rows.jsonl")
    assert [(index, boot, row) for (index, _), (boot, row) in logged.rows.items()] == [
        (0, 0, _row(100)),
        (1, 0, PointRow(200, 2, "skip:decode_injection_failed", detail="pool_exhausted")),
    ]
    assert logged.stages == [{"batch": 2, "depth": 64, "build_seconds": 0.5, "boot": 0}]
    assert logged.next_boot == 1 and not logged.torn


def test_a_torn_last_line_is_left_out_and_cut_off_before_a_resume_appends(tmp_path):
    RowLog(tmp_path, 0, "t0").row(_row(100), 0, 1, 2)
    path = tmp_path / "rows.jsonl"
    whole = path.read_bytes()
    line = json.dumps({"kind": "row", "boot": 0, "index": 1, "row": {"total_kv_read_tokens": 7}}).encode()
    path.write_bytes(whole + line[: len(line) // 2])  # killed mid-write
    logged = read_log(path)
    assert logged.torn and [index for index, _ in logged.rows] == [0]
    resumed = RowLog(tmp_path, 1, "t1")  # a resume cuts the torn tail, then appends
    resumed.row(_row(300), 1, 2, 2)
    logged = read_log(path)
    assert not logged.torn and [b["boot"] for b in logged.boots] == [0, 1]
    assert [(index, boot) for (index, _), (boot, _) in logged.rows.items()] == [(0, 0), (1, 1)]
    cut_torn_tail(tmp_path / "missing.jsonl")  # nothing to cut: no error


def test_a_later_line_for_the_same_point_and_side_replaces_the_earlier_one(tmp_path):
    log = RowLog(tmp_path, 0, "t0")
    log.row(_row(100, v.AB_REAL), 0, 1, 4)
    log.row(_row(100, v.AB_FAKE), 0, 2, 4)
    log.row(_row(200, v.AB_REAL), 1, 3, 4)
    log.row(_row(999, v.AB_REAL), 0, 3, 4)  # measured again (a resume's replacement)
    logged = read_log(tmp_path / "rows.jsonl")
    assert list(logged.rows) == [(0, v.AB_FAKE), (1, v.AB_REAL), (0, v.AB_REAL)]
    assert logged.rows[(0, v.AB_REAL)][1].total_kv_read_tokens == 999


def test_a_line_that_is_not_json_is_refused_by_its_number(tmp_path):
    RowLog(tmp_path, 0, "t0")
    with (tmp_path / "rows.jsonl").open("ab") as f:
        f.write(b"not json\n")
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_log(tmp_path / "rows.jsonl")


def test_the_running_artifact_is_compact_and_unchecked_and_the_final_one_checked_once(tmp_path, monkeypatch):
    checked = []
    monkeypatch.setattr("vllm.kvwarm.record.artifact.validate", checked.append)
    writer = ArtifactWriter(str(tmp_path), {"points": "p.json", "model": "m"})
    writer.start_log()
    writer.total = 3
    for i, k in enumerate((100, 200, 300)):
        writer.add_row(_row(k), i)
        # the row is on disk before (and whether or not) the paced rewrite ran
        assert read_log(tmp_path / "rows.jsonl").rows[(i, None)][1].total_kv_read_tokens == k
    running = (tmp_path / "sweep.json").read_text()
    assert "\n" not in running and json.loads(running)["status"] == "running"
    assert checked == []
    writer.write(v.COMPLETE)
    assert len(checked) == 1 and checked[0]["status"] == "complete" and len(checked[0]["results"]) == 3
    assert (tmp_path / "sweep.json").read_text().count("\n") > 10  # the final one indented, for people
    assert writer.log is None  # closed with the final write


class SlowShare:
    """An exchange whose share of a write takes `seconds` (a stand-in for the store's or the
    files' combine, which the pacing must count)."""

    def __init__(self, seconds: float):
        self.seconds, self.shared = seconds, 0

    def share(self, artifact: dict) -> None:
        time.sleep(self.seconds)
        self.shared += 1


def test_the_pacing_counts_the_exchanges_share_of_each_write(tmp_path):
    writer = ArtifactWriter(str(tmp_path), {"points": "p.json", "model": "m"})
    writer.exchange = SlowShare(writer_module.WRITE_FLOOR * 5)
    writer.start_log()
    writer.add_row(_row(100), 0)
    assert writer.exchange.shared == 1
    writer.add_row(_row(200), 1)  # the last write (its share above the floor) is not paid for yet
    assert writer.exchange.shared == 1
    assert len(read_log(tmp_path / "rows.jsonl").rows) == 2  # the row is on disk all the same


def test_the_file_exchanges_running_combine_never_waits_for_another_ranks_lock(tmp_path):
    rank_0, rank_1 = (FileExchange(tmp_path, "run", 2, r) for r in range(2))
    for rank in range(2):
        (tmp_path / f"dp{rank}").mkdir()
        (tmp_path / f"dp{rank}" / "sweep.json").write_text(
            json.dumps({"status": "running", "error": None, "results": [], "skipped_points": [], "finished_at": None})
        )
    with (tmp_path / ".kvwarm-combine.lock").open("a") as held:  # rank 1's combine, under way
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        rank_0.share({"status": "running"})
        assert time.monotonic() - started < 1.0
        assert not (tmp_path / "sweep.json").exists()  # left to this rank's next write
        fcntl.flock(held, fcntl.LOCK_UN)
    rank_1.share({"status": "running"})  # the next write rebuilds it
    assert json.loads((tmp_path / "sweep.json").read_text())["status"] == "running"


def test_a_running_artifact_is_the_artifact_with_each_row_encoded_once(tmp_path, monkeypatch):
    from vllm.kvwarm.record import encoded as encoded_module
    from vllm.kvwarm.record.artifact import KvwarmMeta, artifact_head, build_artifact
    from vllm.kvwarm.record.encoded import EncodedRows

    made = []
    entry = encoded_module.entry
    monkeypatch.setattr(encoded_module, "entry", lambda row, size: made.append(row) or entry(row, size))
    rows = [_row(100, v.AB_REAL), _row(100, v.AB_FAKE), PointRow(9, 2, "skip:decode_injection_failed", ab=v.AB_FAKE)]
    meta, layout = KvwarmMeta(ab={"first": "alternate"}), {"data_parallel_size": 2, "data_parallel_rank": 1}
    encoded = EncodedRows(2)
    for upto in (1, 3, 3):  # three writes, the rows growing
        head = artifact_head(rows[:upto], meta, {"model": "m"}, v.RUNNING, layout=layout)
        as_written = json.loads(encoded.dumps(head, rows[:upto]))
        assert as_written == build_artifact(rows[:upto], meta, {"model": "m"}, v.RUNNING, layout=layout)
    assert made == rows  # each row's entry made once, whatever the writes
    assert as_written[v.AB_FAKE_SIDE]["skipped_points"][0]["ab"] == v.AB_FAKE
