"""What the trace and the step timer rely on of vLLM's behaviour (docs/hooks.md, the served
trace's contracts H1 to H6), on the real classes of the installed build: each holds under
vLLM's own engine-core loop, and each, broken, is said once by name as the engine runs
(served.contracts) while the engine serves on.

vLLM's loop is its own code: EngineCoreProc._process_engine_step, EngineCore.step and
step_with_batch_queue, and has_work run on a stand-in engine core (`EngineCoreStandIn`) that
holds the real adapter and a played model executor (no model runs here); the test never calls
schedule() or update_from_output() itself there.
"""

from __future__ import annotations

import copy
import logging
import queue
from collections import deque
from concurrent.futures import Future

import pytest
from kvwarm_testing.real_kv import EngineLoop, model_output
from kvwarm_testing.recorded import add, forward_seconds, read, run, traced_scheduler
from vllm.kvwarm.scheduler import KvWarmAsyncScheduler, KvWarmScheduler
from vllm.kvwarm.sweep.in_flight import MAX_IN_FLIGHT
from vllm.v1.core.sched.request_queue import create_request_queue
from vllm.v1.engine.core import EngineCoreProc

LOOPS = [(KvWarmScheduler, False), (KvWarmAsyncScheduler, True)]
LOOP_IDS = ["sync", "batch-queue"]


def _done(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


class PlayedExecutor:
    """A stand-in for the model executor (no model runs on this host): each step's
    ModelRunnerOutput, played by real_kv.model_output when the step is submitted, handed back
    as the executor does (by sample_tokens where the step scheduled tokens)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self._sampled = None

    def execute_model(self, output, non_block: bool = False):
        runner = model_output(self.scheduler, output)
        if not output.total_num_scheduled_tokens:
            return _done(runner) if non_block else runner
        self._sampled = runner
        return _done(None) if non_block else None

    def sample_tokens(self, grammar_output, non_block: bool = False):
        runner, self._sampled = self._sampled, None
        return _done(runner) if non_block else runner

    def take_draft_token_ids(self):
        return None


class EngineCoreStandIn(EngineCoreProc):
    """vLLM's engine core with its own _process_engine_step(), step(), step_with_batch_queue()
    and has_work(), built without its __init__ (which loads a model and opens its sockets): the
    attributes those read, set here."""

    def __init__(self, scheduler, batch_queue: bool):
        self.scheduler = scheduler
        self.vllm_config = scheduler.vllm_config
        self.model_executor = PlayedExecutor(scheduler)
        self.batch_queue_size = 2 if batch_queue else 1
        self.batch_queue = deque(maxlen=2) if batch_queue else None
        self.step_fn = self.step_with_batch_queue if batch_queue else self.step
        self.aborts_queue = queue.Queue()
        self.input_queue = queue.Queue()
        self.output_queue = queue.Queue()
        self._deferred_inputs = []
        self.engines_running = False
        self.log_stats = False
        self._iteration_index = 0
        self._weight_version = None
        # as EngineCore.__init__ derives them from the config (a release reads the ones it has)
        transfer = getattr(self.vllm_config, "ec_transfer_config", None)
        self.is_ec_consumer = transfer is None or transfer.is_ec_consumer
        self.is_mm_encoder_only = bool(getattr(self.vllm_config, "is_mm_encoder_only", False))
        self.is_pooling_model = False
        self.check_for_draft_tokens = False
        self.async_scheduling = batch_queue
        self.prefill_schedule_interval, self.step_counter = 0, 0


class Calls:
    """The outputs schedule() returned and update_from_output() took, in the order of the calls."""

    def __init__(self, scheduler):
        self.calls: list[tuple[str, object]] = []
        schedule, update = scheduler.schedule, scheduler.update_from_output

        def observed_schedule(*args, **kwargs):
            output = schedule(*args, **kwargs)
            self.calls.append(("schedule", output))
            return output

        def observed_update(output, runner_output):
            self.calls.append(("update", output))
            return update(output, runner_output)

        scheduler.schedule, scheduler.update_from_output = observed_schedule, observed_update

    def of(self, kind: str) -> list:
        return [output for k, output in self.calls if k == kind]


@pytest.mark.parametrize("cls, batch_queue", LOOPS, ids=LOOP_IDS)
def test_vllms_engine_loop_keeps_every_contract(tmp_path, cls, batch_queue):
    """H1, H2, H5: the very objects schedule() returned reach update_from_output, each once,
    in order (under the batch queue, a step's schedule() before the last one's update); H3:
    vLLM's has_work() is false exactly when the trace's idle rule says the engine waits; H4:
    each step's cached counts are the counts before it; H6: no queue appears after init. None
    is said broken."""
    scheduler, _, out = traced_scheduler(tmp_path, cls)
    calls = Calls(scheduler)
    core = EngineCoreStandIn(scheduler, batch_queue)
    trace = scheduler.kvwarm_trace
    idle_agrees = []
    for wave in range(3):
        for i in range(5):
            add(scheduler, f"w{wave}r{i}", 40 + 90 * i, max_tokens=6, token=20 + i)
        for _ in range(300):
            if not core.has_work():  # vLLM's own test for blocking on its input queue
                break
            core._process_engine_step()
            idle = not scheduler.has_requests() and not len(scheduler.kvwarm_in_flight)
            idle_agrees.append(idle == (not core.has_work()))
        assert not core.has_work()
    trace.close()
    scheduled, updated = calls.of("schedule"), calls.of("update")
    assert [id(o) for o in updated] == [id(o) for o in scheduled] and len(scheduled) > 20
    assert all(a is b for a, b in zip(updated, scheduled))
    kinds = [k for k, _ in calls.calls]
    overlapped = any(kinds[i : i + 2] == ["schedule", "schedule"] for i in range(len(kinds) - 1))
    assert overlapped == batch_queue  # the batch queue schedules a step before the last one's update
    assert all(idle_agrees) and trace.contracts.broken == {} and trace.unknown == 0
    _, steps = read(out)
    assert [s.untimed for s in steps] == [None] * len(steps)


def test_the_cached_counts_are_the_counts_before_the_step(tmp_path):
    """H4 on the real Scheduler, read off its requests right after each schedule()."""
    scheduler, clock, _ = traced_scheduler(tmp_path, KvWarmScheduler)
    schedule, checked = scheduler.schedule, []

    def observed_schedule(*args, **kwargs):
        output = schedule(*args, **kwargs)
        cached = output.scheduled_cached_reqs
        for req_id, before in zip(cached.req_ids, cached.num_computed_tokens):
            after = scheduler.requests[req_id].num_computed_tokens
            checked.append(before == after - output.num_scheduled_tokens[req_id])
        return output

    scheduler.schedule = observed_schedule
    for i in range(4):
        add(scheduler, f"r{i}", 300 + 30 * i, max_tokens=5, token=40 + i)  # chunked: cached prefill chunks too
    run(EngineLoop(scheduler, False, clock, forward_seconds))
    scheduler.kvwarm_trace.close()
    assert all(checked) and len(checked) > 10


# --- each contract broken: said once, by name; the engine serves on --------------------------


def _said(caplog, name: str) -> int:
    return sum(f"docs/hooks.md {name} (" in r.getMessage() for r in caplog.records)


def test_an_output_update_from_output_did_not_see_scheduled_is_traced_with_no_wall_and_said_once(tmp_path, caplog):
    """H1 broken: update_from_output takes a copy of what schedule() returned (as a release
    that rebuilt the output would): counted, said once, traced with a null wall and the reason."""
    scheduler, clock, out = traced_scheduler(tmp_path, KvWarmScheduler)
    caplog.set_level(logging.WARNING)
    for i in range(3):
        add(scheduler, f"r{i}", 30, max_tokens=4, token=40 + i)
    for _ in range(4):
        output = scheduler.schedule()
        clock.advance(forward_seconds(output))
        scheduler.update_from_output(copy.copy(output), model_output(scheduler, output))
    scheduler.kvwarm_trace.close()
    assert _said(caplog, "H1") == 1 and scheduler.kvwarm_trace.contracts.broken["H1"] == 4
    _, steps = read(out)
    assert len(steps) == 4 and all(s.wall is None and s.untimed == "unknown_output" for s in steps)


def test_an_output_taken_twice_or_never_is_said_once(tmp_path, caplog):
    """H2 broken both ways: an update of an output already taken, and more outputs scheduled
    than ever reach an update (the in-flight record's bound)."""
    scheduler, _, _ = traced_scheduler(tmp_path, KvWarmScheduler)
    caplog.set_level(logging.WARNING)
    add(scheduler, "r", 30, max_tokens=4, token=3)
    output = scheduler.schedule()
    scheduler.update_from_output(output, model_output(scheduler, output))
    scheduler.update_from_output(output, model_output(scheduler, output))
    assert _said(caplog, "H2") == 1
    contracts = scheduler.kvwarm_trace.contracts
    broken = contracts.broken["H2"]
    for _ in range(MAX_IN_FLIGHT + 2):
        scheduler.schedule()  # and never an update
    assert contracts.broken["H2"] == broken + 2 and _said(caplog, "H2") == 1
    scheduler.kvwarm_trace.close()


def test_a_schedule_with_nothing_to_do_is_said_once(tmp_path, caplog):
    """H3 broken: the engine steps with no request and no step in flight (vLLM's loop calls
    schedule() only while has_requests())."""
    scheduler, _, _ = traced_scheduler(tmp_path, KvWarmScheduler)
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        output = scheduler.schedule()
        scheduler.update_from_output(output, model_output(scheduler, output))
    scheduler.kvwarm_trace.close()
    assert _said(caplog, "H3") == 1 and scheduler.kvwarm_trace.contracts.broken["H3"] == 3


def test_cached_counts_after_the_step_are_said_once(tmp_path, caplog):
    """H4 broken: a stand-in release whose CachedRequestData carries a request's computed
    count after the step."""
    from kvwarm_testing.real_kv import ManualClock, make_scheduler
    from kvwarm_testing.recorded import on_clock
    from vllm.kvwarm.scheduler import KvWarmSchedulerMixin
    from vllm.v1.core.sched.scheduler import Scheduler

    class CountsAfterTheStep(Scheduler):
        """A stand-in for a release that fills num_computed_tokens after advancing it."""

        def schedule(self, *args, **kwargs):
            output = super().schedule(*args, **kwargs)
            cached = output.scheduled_cached_reqs
            cached.num_computed_tokens = [self.requests[r].num_computed_tokens for r in cached.req_ids]
            return output

    class Adapter(KvWarmSchedulerMixin, CountsAfterTheStep):
        pass

    clock = ManualClock()
    spec = {"kvwarm_trace": {"out": str(tmp_path / "trace")}}
    scheduler = make_scheduler(
        tmp_path, num_blocks=1024, scheduler_cls=on_clock(Adapter, clock), additional_config=spec
    )
    caplog.set_level(logging.WARNING)
    for i in range(3):
        add(scheduler, f"r{i}", 30, max_tokens=6, token=40 + i)
    run(EngineLoop(scheduler, False, clock, forward_seconds))
    scheduler.kvwarm_trace.close()
    assert not scheduler.requests and _said(caplog, "H4") == 1 and scheduler.kvwarm_trace.contracts.broken["H4"] > 3


def test_outputs_taken_out_of_order_are_said_once(tmp_path, caplog):
    """H5 broken: under the batch queue, the newer step taken in before the older; one step at
    a time, a second schedule() before the first step's update."""
    batch, _, _ = traced_scheduler(tmp_path / "batch", KvWarmAsyncScheduler)
    caplog.set_level(logging.WARNING)
    for i in range(2):
        add(batch, f"r{i}", 30, max_tokens=6, token=40 + i)
    older, newer = batch.schedule(), batch.schedule()
    batch.update_from_output(newer, model_output(batch, newer))
    batch.update_from_output(older, model_output(batch, older))
    batch.kvwarm_trace.close()
    assert _said(caplog, "H5") == 1 and batch.kvwarm_trace.contracts.broken == {"H5": 1}
    sync, _, _ = traced_scheduler(tmp_path / "sync", KvWarmScheduler)
    add(sync, "r", 300, max_tokens=6, token=3)
    sync.schedule()
    sync.schedule()
    sync.kvwarm_trace.close()
    assert sync.kvwarm_trace.contracts.broken == {"H5": 1}


def test_a_waiting_queue_the_adapter_did_not_find_is_said_once(tmp_path, caplog):
    """H6 broken: a release that makes a waiting queue after the scheduler's __init__."""
    scheduler, clock, _ = traced_scheduler(tmp_path, KvWarmScheduler)
    caplog.set_level(logging.WARNING)
    scheduler.later_waiting = create_request_queue(scheduler.policy)
    add(scheduler, "r", 30, max_tokens=4, token=3)
    run(EngineLoop(scheduler, False, clock, forward_seconds))
    scheduler.kvwarm_trace.close()
    assert _said(caplog, "H6") == 1 and "later_waiting" in caplog.text
