"""Several engines of one data-parallel rank writing one trace folder (several DP=1 servers
sharing DYN_BENCH_TRACE_DIR, or a server started again): each launch writes files of its own
names, none deletes or appends to another's, and the reader reads each launch as a stream of
its own, saying so; `export --to fpm` tells the launches apart. On the real Scheduler, two
adapters stepped in turn."""

from __future__ import annotations

import json

from kvwarm_testing.real_kv import EngineLoop
from kvwarm_testing.recorded import add, current_files, forward_seconds, traced_scheduler
from vllm.kvwarm.record.export.command import run as export
from vllm.kvwarm.record.export.fpm import fpm_lines, is_trace
from vllm.kvwarm.record.trace.reader import read_trace
from vllm.kvwarm.scheduler import KvWarmScheduler


def test_two_engines_of_one_rank_in_one_folder_both_write_their_whole_trace(tmp_path):
    folder = tmp_path / "trace"
    loops = []
    for name in ("a", "b"):
        scheduler, clock, out = traced_scheduler(tmp_path, KvWarmScheduler, max_file_mb=4096 / (1 << 20), files=64)
        assert out == folder  # one folder, the same rank (0), as two DP=1 servers sharing it
        loops.append(EngineLoop(scheduler, False, clock, forward_seconds))
        for i in range(6):
            add(scheduler, f"{name}{i}", 20 + 7 * i, max_tokens=16, token=30 + i)
    while any(loop.busy() for loop in loops):  # in turn: both write and rotate at once
        for loop in loops:
            if loop.busy():
                loop.step()
    for loop in loops:
        loop.scheduler.kvwarm_trace.close()
    [first, second] = current_files(folder)
    assert first != second and first.parent == second.parent == folder
    trace = read_trace(folder)
    assert [(s.rank, s.index) for s in trace.streams] == [(0, 0), (0, 1)]
    assert len(trace.files) > 4  # rotated too, each launch its own files
    for stream, loop in zip(trace.streams, sorted(loops, key=lambda x: x.scheduler.kvwarm_trace.launch)):
        recorder = loop.scheduler.kvwarm_trace
        assert stream.launch == recorder.launch and stream.header["started_at"]
        traced = sum(1 for o in loop.outputs if o.total_num_scheduled_tokens)
        numbers = [s.number for s in trace.steps if s.stream == stream.index]
        assert numbers == list(range(traced)) and traced > 12  # every step, in order, none of the other's
        headers = [json.loads(path.read_text().splitlines()[0]) for path in stream.files]
        assert all(header["started_at"] == stream.header["started_at"] for header in headers)
    assert any("rank 0: 2 launches in this folder" in note for note in trace.notes)


def test_the_fpm_capture_tells_the_launches_apart(tmp_path, capsys):
    folder = tmp_path / "trace"
    for name in ("a", "b"):
        scheduler, clock, _ = traced_scheduler(tmp_path, KvWarmScheduler)
        loop = EngineLoop(scheduler, False, clock, forward_seconds)
        for i in range(3):
            add(scheduler, f"{name}{i}", 30, max_tokens=4, token=40 + i)
        while loop.busy():
            loop.step()
        scheduler.kvwarm_trace.close()
    assert is_trace(folder)
    trace = read_trace(folder)
    lines, left_out = fpm_lines(trace)
    workers = {json.loads(x)["metrics"]["worker_id"] for x in lines}
    assert workers == {s.launch for s in trace.streams} and len(workers) == 2
    assert len(lines) + left_out == len(trace.steps)
    assert export([str(folder), "--to", "fpm"]) == 0
    assert "kvwarm export: trace: rank 0: 2 launches in this folder" in capsys.readouterr().err
