"""The trace's writer process (served.writer, served.sink) around the real Scheduler: it ends
with the trace and leaves no process; it ends by itself, having written what it was sent,
when the engine's process dies without closing the trace, even while a process forked from
the engine holds the pipe open; a writer process that falls behind never holds up a step:
steps beyond the bound are dropped and counted, and what was written reads back.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from kvwarm_testing.real_kv import EngineLoop
from kvwarm_testing.recorded import add, forward_seconds, read, run, traced_scheduler
from vllm.kvwarm.scheduler import KvWarmScheduler
from vllm.kvwarm.served import writer

SUPPORT = Path(__file__).resolve().parents[1] / "support"


def _gone(pid: int) -> bool:
    """The process ended (a zombie waiting for its new parent to reap it counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_close_writes_every_step_and_the_writer_process_ends(tmp_path):
    scheduler, clock, out = traced_scheduler(tmp_path, KvWarmScheduler)
    process = scheduler.kvwarm_trace.writer.process
    loop = EngineLoop(scheduler, False, clock, forward_seconds)
    for i in range(6):
        add(scheduler, f"r{i}", 30 + 10 * i, max_tokens=10, token=40 + i)
    run(loop)
    assert process.poll() is None  # alive while the engine serves
    scheduler.kvwarm_trace.close()
    assert process.returncode == 0
    _, steps = read(out)
    assert [s.number for s in steps] == list(range(sum(1 for o in loop.outputs if o.total_num_scheduled_tokens)))


ENGINE = """
    import os, signal, sys, time
    from kvwarm_testing.real_kv import EngineLoop
    from kvwarm_testing.recorded import add, forward_seconds, run, traced_scheduler
    from vllm.kvwarm.scheduler import KvWarmScheduler

    scheduler, clock, out = traced_scheduler(__import__("pathlib").Path(sys.argv[1]), KvWarmScheduler)
    loop = EngineLoop(scheduler, False, clock, forward_seconds)
    for i in range(5):
        add(scheduler, f"r{i}", 40, max_tokens=8, token=50 + i)
    run(loop)
    steps = sum(1 for o in loop.outputs if o.total_num_scheduled_tokens)
    holder = os.fork() if sys.argv[2] == "fork" else 0  # a process forked from the engine holds the pipe
    if holder == 0 and sys.argv[2] == "fork":
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the test reads the engine's output to its end
        time.sleep(60)
        os._exit(0)
    print("writer-process", scheduler.kvwarm_trace.writer.process.pid, steps, holder, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the engine's process dies: no close, no atexit
"""


@pytest.mark.parametrize("held", ["alone", "fork"])
def test_the_writer_process_ends_when_the_engines_process_dies(tmp_path, held):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")])))
    with (tmp_path / "engine.log").open("w") as log:
        engine = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(ENGINE), str(tmp_path), held],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            timeout=300,
            check=False,
        )
    assert engine.returncode == -signal.SIGKILL, (tmp_path / "engine.log").read_text()[-3000:]
    said = next(x for x in engine.stdout.splitlines() if x.startswith("writer-process "))  # vLLM may log here too
    sink, steps, holder = map(int, said.split()[1:])
    try:
        deadline = time.monotonic() + 3 * writer.sink.CHECK_PARENT_SECONDS + 5
        while not _gone(sink) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(sink)
        if held == "fork":
            assert not _gone(holder)  # the pipe was still open: the writer process saw its parent go
    finally:
        if holder:
            os.kill(holder, signal.SIGKILL)
    _, lines = read(tmp_path / "trace")
    assert [s.number for s in lines] == list(range(steps)) and steps > 5


def test_a_writer_process_that_falls_behind_never_holds_up_a_step(tmp_path, monkeypatch, caplog):
    """The writer process stopped (SIGSTOP) with a one-page pipe and a bound of 8 KiB: the
    steps go on, those beyond the bound are dropped and counted; once it runs again, close
    writes the rest, the numbers skipping the dropped steps."""
    monkeypatch.setattr(writer, "PIPE_BYTES", 4096)
    monkeypatch.setattr(writer, "MAX_PENDING_BYTES", 8192)
    scheduler, clock, out = traced_scheduler(tmp_path, KvWarmScheduler)
    trace = scheduler.kvwarm_trace
    os.kill(trace.writer.process.pid, signal.SIGSTOP)
    try:
        loop = EngineLoop(scheduler, False, clock, forward_seconds)
        for i in range(24):
            add(scheduler, f"r{i}", 20 + i, max_tokens=20, token=60 + i)
        run(loop)
    finally:
        os.kill(trace.writer.process.pid, signal.SIGCONT)
    traced = sum(1 for o in loop.outputs if o.total_num_scheduled_tokens)
    assert trace.writer.dropped > 0
    with caplog.at_level(logging.WARNING):
        trace.close()
    assert f"{trace.writer.dropped} step(s) dropped" in caplog.text
    _, steps = read(out)
    numbers = [s.number for s in steps]
    assert numbers == sorted(set(numbers)) and numbers[0] == 0
    assert len(numbers) + trace.writer.dropped == traced
    assert json.loads((out / "trace-dp0.jsonl").read_text().splitlines()[0])["type"] == "kvwarm_trace"
