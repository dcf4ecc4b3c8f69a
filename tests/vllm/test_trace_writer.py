"""The trace's writer process (served.writer, served.sink) around the real Scheduler: it ends
with the trace and leaves no process; it ends by itself, having written what it was sent,
when the engine's process dies without closing the trace, even while a process forked from
the engine holds the pipe open; a writer process that falls behind never holds up a step:
steps are dropped only while the bound is full, the gap logged and recorded, and the trace
resumes once it catches up; one that is killed is logged when it happens and at close.
"""

from __future__ import annotations

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
from vllm.kvwarm.record.trace.reader import read_trace
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


BOUND_MB = 8192 / (1 << 20)  # a bound of 8 KiB (and so a pipe of 8 KiB): a few dozen steps fill it


def _traced(loop) -> int:
    """The steps traced so far: every step that scheduled a token (no sweep here)."""
    return sum(1 for output in loop.outputs if output.total_num_scheduled_tokens)


def _serve_until(scheduler, loop, done, name: str, limit: float = 120.0) -> None:
    """Step `loop`, adding a short request whenever it runs dry, until `done()`."""
    deadline, k = time.monotonic() + limit, 0
    while not done():
        assert time.monotonic() < deadline, f"not {done.__doc__} within {limit} s"
        if not loop.busy():
            add(scheduler, f"{name}{k}", 20, max_tokens=4, token=90 + k % 50)
            k += 1
        loop.step()


def test_a_stalled_writer_process_drops_steps_only_while_the_bound_is_full_and_the_trace_resumes(tmp_path, caplog):
    """The writer process stopped (SIGSTOP) long enough to fill the bound, then run again
    (SIGCONT) mid-run: the steps go on meanwhile, those beyond the bound are dropped, logged
    once when it starts and once when it ends, and recorded where they were; the steps served
    after the resume are all written."""
    scheduler, clock, out = traced_scheduler(tmp_path, KvWarmScheduler, max_pending_mb=BOUND_MB)
    trace = scheduler.kvwarm_trace
    writer_process = trace.writer.process
    loop = EngineLoop(scheduler, False, clock, forward_seconds)
    caplog.set_level(logging.WARNING)
    os.kill(writer_process.pid, signal.SIGSTOP)
    try:

        def dropping():
            """dropping steps"""
            return trace.writer.dropping

        _serve_until(scheduler, loop, dropping, "stalled")
        for i in range(8):  # the stall goes on: more steps dropped, the gap said once
            add(scheduler, f"more{i}", 20 + i, max_tokens=20, token=60 + i)
        run(loop)
        said_during = caplog.text
    finally:
        os.kill(writer_process.pid, signal.SIGCONT)
    assert said_during.count("has not taken the last 8 KiB of steps") == 1
    assert f"pid {writer_process.pid}" in said_during and "takes steps again" not in said_during

    def resumed():
        """taking steps again"""
        return not trace.writer.dropping

    _serve_until(scheduler, loop, resumed, "resumed")
    first_after = _traced(loop)  # the number the next traced step gets
    for i in range(12):
        add(scheduler, f"after{i}", 20 + i, max_tokens=12, token=70 + i)
    run(loop)
    trace.close()
    assert caplog.text.count("takes steps again") == 1
    assert f"{trace.writer.dropped} step(s) dropped" in caplog.text
    numbers = [s.number for s in read(out)[1]]
    after = [n for n in numbers if n >= first_after]
    assert after == list(range(first_after, _traced(loop))) and len(after) > 20  # every step after the resume
    [gap] = read_trace(out).dropped
    assert gap.steps == trace.writer.dropped > 0 and gap.untraced == trace.writer.dropped_untraced
    assert len(numbers) + gap.steps == _traced(loop)  # the numbers skip exactly the dropped steps
    skipped = sorted(set(range(_traced(loop))) - set(numbers))
    assert skipped == list(range(skipped[0], skipped[0] + gap.steps))  # one gap, where the record says
    steps = {s.number: s for s in read(out)[1]}
    assert steps[skipped[0] - 1].at < gap.start <= gap.end < steps[skipped[-1] + 1].at


def test_a_killed_writer_process_is_logged_when_it_happens_and_at_close_and_the_engine_serves_on(tmp_path, caplog):
    scheduler, clock, out = traced_scheduler(tmp_path, KvWarmScheduler)
    trace = scheduler.kvwarm_trace
    loop = EngineLoop(scheduler, False, clock, forward_seconds)
    caplog.set_level(logging.WARNING)
    for i in range(4):
        add(scheduler, f"before{i}", 30, max_tokens=6, token=40 + i)
    run(loop)  # the engine goes idle: what waits is sent
    before = _traced(loop)
    deadline = time.monotonic() + 30
    while len(read(out)[1]) < before and time.monotonic() < deadline:  # written, before the kill
        time.sleep(0.05)
    os.kill(trace.writer.process.pid, signal.SIGKILL)
    trace.writer.process.wait(timeout=30)
    for i in range(6):
        add(scheduler, f"after{i}", 30, max_tokens=6, token=50 + i)
    run(loop)
    said_when = caplog.text
    trace.close()
    assert not scheduler.requests  # every request served
    assert said_when.count("is gone (killed by SIGKILL") == 1 and "the engine serves on" in said_when
    assert "ended without its report (killed by SIGKILL" in caplog.text.removeprefix(said_when)
    assert [s.number for s in read(out)[1]] == list(range(before))  # what it wrote before it died
