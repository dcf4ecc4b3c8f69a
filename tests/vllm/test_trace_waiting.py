"""What waits after a traced step (the line's `queued` sums), on the real Scheduler: the queues
are read as they are held, never in their order (a priority queue's iteration sorts a copy of
its heap), only for steps the trace keeps (a sweep's own steps and empty ones read nothing),
and the writer gets the sums, not the backlog."""

from __future__ import annotations

import json
import statistics

import pytest
from kvwarm_testing.real_kv import EngineLoop, make_request, make_scheduler
from kvwarm_testing.recorded import add, forward_seconds, read, run, traced_scheduler
from vllm.kvwarm.scheduler import KvWarmScheduler


def _priority(scheduler) -> None:
    """The scheduler's policy made priority (as --scheduling-policy priority makes it), its
    queues empty ones of that policy, before any request comes."""
    from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue

    scheduler.policy = SchedulingPolicy.PRIORITY
    for name in scheduler.kvwarm_queues:
        setattr(scheduler, name, create_request_queue(SchedulingPolicy.PRIORITY))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_queued_sums_are_what_waits_after_each_traced_step_read_without_ordering(tmp_path, monkeypatch, policy):
    """20 requests at once against max_num_seqs 8 and 256 tokens a step: a backlog that drains. After
    each traced schedule() the test reads what waits (in the queues' own order); the trace's
    line says the same counts, tokens and variance, and no one else iterated a priority queue
    (its sorting path)."""
    from vllm.v1.core.sched.request_queue import PriorityRequestQueue

    scheduler, clock, out = traced_scheduler(tmp_path, KvWarmScheduler)
    if policy == "priority":
        _priority(scheduler)
    reading, iterations = [False], []  # whether the test itself reads the queues; every iteration
    iterate = PriorityRequestQueue.__iter__

    def counted_iter(queue):
        iterations.append(reading[0])
        return iterate(queue)

    monkeypatch.setattr(PriorityRequestQueue, "__iter__", counted_iter)
    waits = []
    schedule = scheduler.schedule

    def observed(*args, **kwargs):
        output = schedule(*args, **kwargs)
        if output.total_num_scheduled_tokens:
            reading[0] = True
            waits.append([r.num_prompt_tokens for name in scheduler.kvwarm_queues for r in getattr(scheduler, name)])
            reading[0] = False
        return output

    scheduler.schedule = observed
    for i in range(20):
        request = make_request(f"r{i}", 20 + 7 * i, token=30 + i)
        request.sampling_params.max_tokens = request.max_tokens = 3
        request.priority = (i * 7) % 3  # before it is queued: the heap orders by it
        scheduler.add_request(request)
    run(EngineLoop(scheduler, False, clock, forward_seconds))
    scheduler.kvwarm_trace.close()
    _, steps = read(out)
    assert len(steps) == len(waits) and max(map(len, waits)) > 8  # a backlog beyond a step's requests
    for line, prompts in zip(steps, waits):
        assert (line.queued["requests"], line.queued["tokens"]) == (len(prompts), sum(prompts))
        assert line.queued["var"] == pytest.approx(statistics.pvariance(prompts) if prompts else 0.0)
        assert line.queued["resuming"] == 0
    assert False not in iterations  # no one but the test iterated a priority queue (it sorts)
    if policy == "priority":
        assert iterations  # the check above could fail: the test's own reads did iterate


def test_a_sweeps_own_steps_and_empty_steps_read_no_queue(tmp_path, monkeypatch):
    """A sweep (fake KV) and the trace in one engine, users' requests arriving during it: the
    recorder is given the queues only for the steps it traces."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    points = tmp_path / "points.json"
    decode = [{"total_kv_read_tokens": k, "batch_size": 2} for k in (64, 128, 192)]
    points.write_text(json.dumps({"schema_version": 1, "decode": decode}))
    spec = {
        "kvwarm_sweep": {"points": str(points), "out": str(tmp_path / "sweep")},
        "kvwarm_trace": {"out": str(tmp_path / "trace")},
    }
    scheduler = make_scheduler(tmp_path, num_blocks=1024, scheduler_cls=KvWarmScheduler, additional_config=spec)
    given = []  # (the step's own requests, empty, queues given)
    scheduled = scheduler.kvwarm_trace.scheduled

    def recorded(scheduler, output, held, queues, enter):
        given.append((held, not output.total_num_scheduled_tokens, len(queues)))
        return scheduled(scheduler, output, held, queues, enter)

    scheduler.kvwarm_trace.scheduled = recorded
    loop = EngineLoop(scheduler, False)
    for i in range(400):
        if i < 6:
            add(scheduler, f"u{i}", 30 + 20 * i, max_tokens=5, token=20 + i)
        if not loop.busy():
            break
        loop.step()
    scheduler.kvwarm_trace.close()
    assert json.loads((tmp_path / "sweep" / "sweep.json").read_text())["status"] == "complete"
    read_none = [queues == 0 for held, empty, queues in given if held or empty]
    read_all = [queues == len(scheduler.kvwarm_queues) for held, empty, queues in given if not (held or empty)]
    assert read_none and all(read_none) and read_all and all(read_all)
