"""Served-step traces made on the real Scheduler (the recorder of the patched build, stepped
in vLLM's engine orders by real_kv.EngineLoop, the runner's part played on a clock only it
moves), for the tests of the trace and of what reads it."""

from __future__ import annotations

import json
from pathlib import Path

from .real_kv import EngineLoop, ManualClock, make_request, make_scheduler


def forward_seconds(output) -> float:
    """The played runner's time for a step: grows with its tokens, so that every window differs."""
    return 0.002 + 0.0001 * output.total_num_scheduled_tokens


def on_clock(cls, clock):
    """A subclass of the adapter class `cls` whose clock (`kvwarm_clock`, read by its step
    timer and its trace alike; time.perf_counter in the real one) is `clock`."""
    return type(cls.__name__, (cls,), {"kvwarm_clock": staticmethod(clock)})


def traced_scheduler(tmp_path: Path, cls, **settings):
    """An adapter of class `cls` with the trace on (in tmp_path/trace) on a ManualClock that
    reads 0 when the trace starts: (scheduler, clock, trace folder)."""
    out = tmp_path / "trace"
    spec = {"kvwarm_trace": {"out": str(out), **settings}}
    clock = ManualClock()
    scheduler = make_scheduler(tmp_path, num_blocks=1024, scheduler_cls=on_clock(cls, clock), additional_config=spec)
    return scheduler, clock, out


def add(scheduler, name: str, prompt: int, max_tokens: int, token: int) -> None:
    """A request of `prompt` tokens (all `token`: prompts of one token share their prefix)."""
    request = make_request(name, prompt, token=token)
    request.sampling_params.max_tokens = request.max_tokens = max_tokens
    scheduler.add_request(request)


def run(loop: EngineLoop, limit: int = 500) -> None:
    """Step until the engine has nothing left."""
    for _ in range(limit):
        if not loop.busy():
            return
        loop.step()
    raise AssertionError("the requests did not finish")


def serve(scheduler, loop: EngineLoop, arrivals: dict[int, list[tuple[str, int, int]]], max_tokens: int = 8) -> None:
    """Requests arriving at given steps ({step: [(name, prompt, token)]}), then to the end."""
    for i in range(max(arrivals) + 1):
        for name, prompt, token in arrivals.get(i, []):
            add(scheduler, name, prompt, max_tokens, token)
        loop.step()
    run(loop)
    scheduler.kvwarm_trace.close()


# Prompts longer than the test scheduler's step budget (256 tokens) chunk, so decode, prefill
# and mixed steps all occur; prompts of one token share their first blocks (a prefix hit).
MIXED_ARRIVALS = {0: [("a", 40, 7), ("b", 600, 9)], 3: [("c", 300, 7)], 6: [("d", 90, 11), ("e", 333, 7)], 11: []}


def made_trace(tmp_path: Path, batch_queue: bool = False) -> Path:
    """A served trace of MIXED_ARRIVALS on the sync or the async adapter; its folder."""
    from vllm.kvwarm.scheduler import KvWarmAsyncScheduler, KvWarmScheduler

    scheduler, clock, out = traced_scheduler(tmp_path, KvWarmAsyncScheduler if batch_queue else KvWarmScheduler)
    serve(scheduler, EngineLoop(scheduler, batch_queue, clock, forward_seconds), MIXED_ARRIVALS)
    return out


def rotated_trace(tmp_path: Path, files: int, requests: int, max_tokens: int) -> Path:
    """A trace of `requests` requests on the sync adapter with files rotated at 4 KiB and
    `files` kept; its folder (the writer closed)."""
    from vllm.kvwarm.scheduler import KvWarmScheduler

    scheduler, clock, out = traced_scheduler(tmp_path, KvWarmScheduler, max_file_mb=4096 / (1 << 20), files=files)
    loop = EngineLoop(scheduler, False, clock, forward_seconds)
    for i in range(requests):
        add(scheduler, f"r{i}", 20, max_tokens=max_tokens, token=30 + i)
    run(loop)
    scheduler.kvwarm_trace.close()
    return out


def current_files(out: Path, rank: int = 0) -> list[Path]:
    """Each launch's current trace file of `rank` in `out`, the earliest launch first."""
    from vllm.kvwarm.record.trace.reader import stream_files

    return [files[-1] for (of, _), files in stream_files(out).items() if of == rank]


def read(out: Path) -> tuple[dict, list]:
    """Rank 0's header as written (one launch's), and every step as validate reads it
    (record.trace.reader's Steps: the raw numbers composed); no steps where the recorder
    wrote none."""
    from vllm.kvwarm.record.trace.reader import read_trace

    [current] = current_files(out)
    lines = current.read_text().splitlines()
    return json.loads(lines[0]), (read_trace(out).steps if len(lines) > 1 else [])
