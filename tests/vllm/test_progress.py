"""A sweep's progress on long work: planned and done rows, the rate and the time left; a
point's line logged at most once per LOG_SECONDS (a server's log gets no line per point), and
the command's reading of a running artifact paced as it grows."""

from __future__ import annotations

import itertools
import json

from kvwarm_testing.real_kv import make_scheduler, step_scheduler
from vllm.kvwarm.record.artifact import PointRow
from vllm.kvwarm.scheduler import KvWarmScheduler
from vllm.kvwarm.sweep import progress
from vllm.kvwarm.sweep.progress import ArtifactRows, PointLog, rate_line
from vllm.kvwarm.sweep.writer import ArtifactWriter


def test_a_line_says_done_and_planned_rows_the_rate_and_the_time_left():
    assert rate_line(300, 1200, 60.0) == "300/1200 rows, 300 rows/min, about 3 min 00 s left"
    assert rate_line(100, 100_000, 30.0) == "100/100000 rows, 200 rows/min, about 8 h 19 min left"
    assert rate_line(5, 5, 10.0) == "5/5 rows, 30 rows/min"  # done: no time left


def test_a_point_line_is_logged_at_once_then_at_most_once_per_period():
    said, now = [], [0.0]
    log = PointLog(said.append, every=30.0, clock=lambda: now[0])
    row = PointRow(64, 2, "legacy", samples=[0.001], median_seconds=0.001)
    for done in range(1, 101):  # a point every second for 100 s
        now[0] = float(done)
        log.row(row, done, 100)
    assert [line.split(" K=")[0] for line in said] == ["point 1/100", "point 31/100", "point 61/100", "point 91/100"]
    assert "K=64 B=2 (legacy): 1.00 ms; 31/100 rows, 60 rows/min, about 1 min 09 s left" in said[1]
    log.quiet = True
    now[0] = 1000.0
    log.row(row, 100, 100)
    assert len(said) == 4


def test_a_resumed_sweeps_rate_counts_only_the_rows_measured_in_this_boot():
    """500 rows came from an earlier boot: 60 rows in this boot's first 60 s are 60 a minute,
    not 560, and the time left follows from that."""
    said, now = [], [0.0]
    log = PointLog(said.append, every=30.0, clock=lambda: now[0])
    row = PointRow(64, 2, "legacy", samples=[0.001], median_seconds=0.001)
    for done in range(501, 561):
        now[0] = float(done - 500)
        log.row(row, done, 1000)
    assert said[-1].endswith("531/1000 rows, 60 rows/min, about 7 min 49 s left")


def test_a_sweep_in_a_server_logs_no_line_per_point(tmp_path, monkeypatch):
    """A real Scheduler's sweep of 12 points (fake KV) within one period logs the first point's
    line and its rungs' and end's, not twelve point lines."""
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    monkeypatch.setattr(progress, "LOG_SECONDS", 3600.0)
    said = []
    monkeypatch.setattr(ArtifactWriter, "progress", lambda self, message, left_too=True: said.append(message))
    points = tmp_path / "points.json"
    decode = [{"total_kv_read_tokens": 8 * (i + 1), "batch_size": 1 + i % 2} for i in range(12)]
    points.write_text(json.dumps({"schema_version": 1, "decode": decode}))
    spec = {"points": str(points), "out": str(tmp_path / "out")}
    scheduler = make_scheduler(tmp_path, scheduler_cls=KvWarmScheduler, additional_config={"kvwarm_sweep": spec})
    for _ in itertools.takewhile(lambda _: scheduler.has_requests(), range(2000)):
        step_scheduler(scheduler)
    assert scheduler.kvwarm_sweep.done and len(scheduler.kvwarm_sweep.rows) == 12
    lines = [m for m in said if m.startswith("point ")]
    assert len(lines) == 1 and lines[0].startswith("point 1/12 ") and "rows/min" in lines[0]
    assert "sweep done: 12/12 row(s)" in said


def test_the_command_reads_a_running_artifact_less_often_as_it_grows(tmp_path, monkeypatch):
    """A combined view of 2 ranks: rows done (measured and skipped) over the planned, the grid's
    points once recorded; reads paced so they take at most READ_SHARE of the time."""
    path = tmp_path / "sweep.json"
    view = {
        "status": "running",
        "ranks": [{"rank": 0, "rows": 3}, {"rank": 1, "rows": 2}],
        "results": [{}] * 3,
        "skipped_points": [{"rank": 1}],
        "kvwarm": {"grid": {"points": 4}},
    }
    path.write_text(json.dumps(view))
    now = [0.0]
    rows = ArtifactRows(path, None, ranks=2)
    rows._pacing.clock = lambda: now[0]
    rows.read()
    assert (rows.done, rows.planned, rows.final) == (6, 8, False)
    rows._pacing.wrote(-1.0)  # as if that read had taken a second
    path.write_text(json.dumps({**view, "status": "complete"}))
    now[0] = 10.0
    rows.read()  # 10 s after a 1 s read: 1 / (10 + 1) > READ_SHARE, so not read again yet
    assert rows.status == "running"
    now[0] = 1 / progress.READ_SHARE
    rows.read()
    assert rows.final and rows.status == "complete"
