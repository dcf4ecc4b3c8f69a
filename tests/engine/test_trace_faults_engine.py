"""The served-step trace under faults on the real CPU engine: a tiny MoE behind vLLM's OpenAI
server (its own processes), loaded by vLLM's own client (`vllm.benchmarks.serve`), as
tests/engine/test_served_trace_engine.py serves it.

- The trace's writer process stopped (SIGSTOP) longer than it takes to fill the trace's bound
  (made small with the setting's max_pending_mb), then run again (SIGCONT): the gap is
  logged once when it starts and once when it ends, recorded in the trace, and every step
  served after the resume is traced (held against the server's own count of its steps).
  Then killed (SIGKILL): the engine serves on, and the loss is logged when it happens (the
  next send) and at close.
- Two servers of one data-parallel rank (DP=1 each) tracing into one folder at once: both
  traces whole, each held against its own server's count.

Runs in the `command` group (its engines in processes of their own).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from kvwarm_testing.multi_rank import ADAPTER, api_server, engine_args, session_processes
from kvwarm_testing.served import load_args, metric, random_dataset, run_load, settled

pytestmark = pytest.mark.command

BOUND_MB = 16 / 1024  # 16 KiB: a few dozen steps of this load fill it, and the pipe (as large)
SINK = b"kvwarm/served/sink.py"


def _model(tmp_path: Path) -> Path:
    from kvwarm_testing.engine import fp32_moe_refusal, skip_where_refused
    from kvwarm_testing.tiny_models import make_tiny_qwen3_moe

    skip_where_refused(fp32_moe_refusal())
    return make_tiny_qwen3_moe(tmp_path / "tiny-moe")


def _server_args(model: Path, trace: Path, *extra: str, **settings) -> list[str]:
    config = json.dumps({"kvwarm_trace": {"out": str(trace), **settings}})
    return engine_args(model, "--scheduler-cls", ADAPTER, "--additional-config", config, *extra)


def _load(server, tmp_path: Path, name: str, requests: int, output_len: int = 16) -> dict:
    budget = 256  # engine_args' --max-num-batched-tokens: prompts of two budgets chunk
    args = load_args(server.url, server.model, random_dataset(2 * budget, output_len, 0.5), requests, rate=40)
    result = run_load(args, tmp_path / f"load-{name}.log")
    assert result["completed"] == requests and not result["failed"], result
    return result


def _counts(server) -> tuple[float, float]:
    """The server's steps that sent outputs, and the tokens they sent."""
    return metric(server.url, "vllm:iteration_tokens_total_count"), metric(server.url, "vllm:generation_tokens_total")


def _writer_pid(server) -> int:
    [pid] = [pid for pid, cmdline in session_processes(server.pid).items() if SINK in cmdline]
    return pid


def _engine_pid(server) -> int:
    """The process the engine (its scheduler) runs in: the trace's writer process's parent."""
    return int(Path(f"/proc/{_writer_pid(server)}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _said(log: Path, text: str, timeout: float = 60.0) -> str:
    """The server's log once it holds `text` (the engine logs as it serves)."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{text!r} not in {log} within {timeout:.0f} s"
        time.sleep(0.5)
    return log.read_text(errors="replace")


def _trace(folder: Path):
    from vllm.kvwarm.record.trace.reader import read_trace

    return read_trace(folder)


def test_a_stalled_writer_resumes_and_a_killed_one_is_said_while_the_server_serves_on(tmp_path):
    model, trace, log = _model(tmp_path), tmp_path / "trace", tmp_path / "server.log"
    started = time.monotonic()
    # a graceful stop (with vLLM's default, 0, the server kills its engine core at once)
    args = _server_args(model, trace, "--shutdown-timeout", "30", max_pending_mb=BOUND_MB)
    with api_server(args, {}, log) as server:
        writer = _writer_pid(server)
        _load(server, tmp_path, "before", 8)
        os.kill(writer, signal.SIGSTOP)
        try:
            _load(server, tmp_path, "stalled", 40, output_len=24)
            stalled = _said(log, "has not taken the last 16 KiB of steps")
        finally:
            os.kill(writer, signal.SIGCONT)
        assert stalled.count("has not taken the last") == 1 and f"(pid {writer})" in stalled
        assert "takes steps again" not in stalled
        resumed_from = _counts(server)
        _load(server, tmp_path, "resumed", 24)
        _said(log, "takes steps again")
        settled(lambda: (len(_trace(trace).steps), _counts(server)))
        after = _counts(server)
        read = _trace(trace)
        # the writer killed: the server serves on, the loss said at the next send
        os.kill(writer, signal.SIGKILL)
        _load(server, tmp_path, "killed", 8)
        killed = _said(log, "is gone (killed by SIGKILL")
        # the API server alone stopped: it stops its engine core in order, which closes the trace
        # (a SIGTERM to every process of the server kills the workers under the engine core first)
        os.kill(server.pid, signal.SIGTERM)
        closed = _said(log, "ended without its report")
    print(f"stalled, resumed and killed writer: {time.monotonic() - started:.0f} s")
    assert killed.count("is gone (killed by SIGKILL") == 1 and "the engine serves on" in killed
    assert "ended without its report (killed by SIGKILL" in closed.removeprefix(killed)
    assert closed.count("takes steps again") == 1
    [gap] = read.dropped
    numbers = [s.number for s in read.steps]
    assert numbers == sorted(numbers) and len(numbers) + gap.steps == numbers[-1] + 1 and gap.steps > 0
    after_gap = [s for s in read.steps if s.at > gap.end]
    assert [s.number for s in after_gap] == list(range(after_gap[0].number, numbers[-1] + 1))
    assert after_gap[0].number == gap.steps + sum(s.at < gap.start for s in read.steps)  # right after the gap
    # every step served after the resume is traced: the server's own count of them
    assert sum(1 for s in after_gap if s.outputs) == after[0] - resumed_from[0] > 20
    assert sum(s.outputs for s in after_gap) == after[1] - resumed_from[1]


def test_two_servers_of_one_rank_tracing_into_one_folder_both_write_their_whole_trace(tmp_path):
    model, trace = _model(tmp_path), tmp_path / "trace"
    started = time.monotonic()
    with ExitStack() as stack:
        servers = [
            stack.enter_context(api_server(_server_args(model, trace), {}, tmp_path / f"server-{k}.log"))
            for k in (0, 1)
        ]
        launches = {s.pid: _engine_pid(s) for s in servers}  # a launch is named by its engine's pid
        loads = [threading.Thread(target=_load, args=(s, tmp_path, f"{k}", 16)) for k, s in enumerate(servers)]
        for thread in loads:  # at once: both engines write and flush into the folder together
            thread.start()
        for thread in loads:
            thread.join()
        counted = settled(lambda: ([_counts(s) for s in servers], len(_trace(trace).steps)))[0]
        read = _trace(trace)
    print(f"two servers of one rank: {time.monotonic() - started:.0f} s")
    assert [s.rank for s in read.streams] == [0, 0]
    assert any("rank 0: 2 launches in this folder" in note for note in read.notes)
    for server, (steps_sent, tokens) in zip(servers, counted):
        [stream] = [s for s in read.streams if s.launch.endswith(f"-p{launches[server.pid]}")]
        steps = [s for s in read.steps if s.stream == stream.index]
        assert [s.number for s in steps] == list(range(len(steps)))
        assert sum(1 for s in steps if s.outputs) == steps_sent > 10  # the rule, per server
        assert sum(s.outputs for s in steps) == tokens
