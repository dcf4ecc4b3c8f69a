"""The scheduler adapter (`--scheduler-cls vllm.kvwarm.scheduler.KvWarmAsyncScheduler` where
vLLM resolves async scheduling on, its default on CUDA; `KvWarmScheduler` where it is off, as
on CPU): stock scheduling, plus the admission of queued shadows at the end of each
`schedule()`. Everything else lives in plain objects (kv.injector.ShadowInjector,
sweep.controller.Sweep) that tests drive against a real scheduler without an engine.

The class must match the engine's loop: with async scheduling on, vLLM's engine core runs a
batch queue (the next step's schedule() before this step's update_from_output), which only
the async class serves (its output placeholders let a request be scheduled while its last
step is in flight); the sync class there gets every other step empty, and the sweep would
time the wrong windows. vLLM says nothing about that for a class under `vllm.`, so the
adapter refuses a mismatch when it is built (AdapterMismatch), naming both ways out;
sweep.provenance.adapter_for names the class that matches a resolved config (the sweep command
uses it).

With nothing queued it schedules exactly as the class it extends. With
additional_config {"kvwarm_sweep": {"points": FILE, "out": DIR}} it runs a decode sweep
(sweep.run.SweepRun) from its first step, in whichever process the scheduler lives. With
{"kvwarm_trace": {"out": DIR}} (or DYN_BENCH_TRACE_DIR) it records every step it serves
outside a sweep (served.recorder); without either it keeps no timer and does no hook work.

A configured sweep never takes the engine down: every sweep hook runs under one failure
handling that records the error in the artifact (status "failed"), gives back the
sweep's requests and blocks, and lets the engine serve on. While a point is admitted and
measured, requests that are not the sweep's (a server's own) wait in their queues and
are scheduled between points, so no timed step carries them.
"""

from __future__ import annotations

import time

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue, create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler

from .kv.catchup import lone_prefill_budget
from .kv.injector import ShadowInjector
from .served.recorder import TraceRecorder
from .served.settings import trace_settings
from .sweep.in_flight import MAX_IN_FLIGHT, InFlight, Scheduled
from .sweep.provenance import ASYNC_ADAPTER, SYNC_ADAPTER
from .sweep.run import CONFIG_KEY, SweepRun
from .sweep.timing import StepTimer

logger = init_logger(__name__)


class AdapterMismatch(ValueError):
    """The adapter class does not match the engine's resolved async scheduling."""


def check_matches_loop(scheduler) -> None:
    """Raise AdapterMismatch where the adapter's class is not the one for its engine's loop."""
    is_async = isinstance(scheduler, AsyncScheduler)
    wants_async = bool(scheduler.vllm_config.scheduler_config.async_scheduling)
    if is_async == wants_async:
        return
    name = ASYNC_ADAPTER if is_async else SYNC_ADAPTER
    if wants_async:
        raise AdapterMismatch(
            f"--scheduler-cls {name} is the synchronous adapter, and this engine resolved async scheduling on "
            "(vLLM's default where nothing rules it out): its engine loop schedules each step before the last "
            "one's output is in, which the synchronous adapter cannot serve (every other step would run empty, "
            f"and a sweep would time the wrong windows). Pass --scheduler-cls {ASYNC_ADAPTER}, or keep this "
            "class and pass --no-async-scheduling"
        )
    raise AdapterMismatch(
        f"--scheduler-cls {name} is the async adapter, and this engine resolved async scheduling off (the CPU "
        "platform turns it off whatever is asked, and vLLM does where an option rules it out): its engine loop "
        f"runs one step at a time. Pass --scheduler-cls {SYNC_ADAPTER}, or keep this class and pass "
        "--async-scheduling where the engine allows it"
    )


class KvWarmSchedulerMixin:
    # The adapter's clock: its step timer and the trace read it (a test's subclass may play
    # another); a sweep's timer reads time.perf_counter, the same clock.
    kvwarm_clock = staticmethod(time.perf_counter)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_matches_loop(self)
        self.kvwarm_injector = ShadowInjector()
        self.kvwarm_prefill_cap = None  # while a catchup.PrefillChunkCap is applied: its size
        self.kvwarm_sweep = None  # a sweep.controller.Sweep while one runs
        self.kvwarm_run = None  # the SweepRun that owns it, when configured
        # A StepTimer that times every step while no sweep runs (benchmarks of natural requests)
        self.kvwarm_timer = None
        self.kvwarm_trace = None  # a served.recorder.TraceRecorder when the trace is on
        # The steps scheduled and not yet taken in, while a timer runs: what its schedule() gave
        # the timer and the trace, kept here since the timer may change before the update.
        self.kvwarm_in_flight = InFlight()
        # The open window holds the sweep's work between points (its phase or rows moved in a
        # hook): the trace's step whose update closes it gets no wall (finding 7 of the review).
        self.kvwarm_sweep_moved = False
        # Every queue of waiting requests this scheduler keeps (`waiting`, and as the release
        # has them `skipped_waiting`, `kv_holding_waiting`, `async_kv_waiting`), found by type
        # so a queue a release adds is held out of measured steps too; made once, in __init__.
        self.kvwarm_queues = [name for name, value in vars(self).items() if isinstance(value, RequestQueue)]
        additional = self.vllm_config.additional_config
        trace = trace_settings(additional)
        if trace is not None:
            self.kvwarm_trace = TraceRecorder(self, trace, self.kvwarm_clock)
            self.kvwarm_timer = StepTimer(self.kvwarm_clock)
        spec = additional.get(CONFIG_KEY) if isinstance(additional, dict) else None
        if spec is not None:
            self.kvwarm_run = SweepRun(self, spec)
            self.kvwarm_sweep = self.kvwarm_run.sweep

    def _drive(self, hook, *args) -> None:
        """Run a sweep hook. Under a configured run a failure ends the sweep (recorded,
        its requests given back) and the engine serves on; a bare sweep (tests) raises."""
        try:
            hook(*args)
        except Exception as err:
            if self.kvwarm_run is None:
                raise
            logger.exception("kvwarm sweep failed; the engine serves on")
            try:  # first give back and tell the other ranks, then record (the last record may end the run)
                self.kvwarm_sweep.abandon(self, f"{type(err).__name__}: {err}")
            except Exception:
                logger.exception("kvwarm sweep: giving back the sweep's requests failed")
            self.kvwarm_run.fail(err)

    def _sweep_step(self) -> None:
        self.kvwarm_sweep.before_schedule(self)
        if self.kvwarm_sweep.done and self.kvwarm_run is not None:
            self.kvwarm_run.finish()

    def _live_sweep(self):
        sweep = self.kvwarm_sweep
        return sweep if sweep is not None and not sweep.done else None

    def _step_timer(self):
        sweep = self._live_sweep()
        return sweep.timer if sweep is not None else self.kvwarm_timer

    def schedule(self, *args, **kwargs):  # vLLM passes e.g. throttle_prefills
        sweep, timer = self._live_sweep(), self._step_timer()
        clock = timer.clock if timer is not None else None
        enter = clock() if clock else 0.0
        trace = self.kvwarm_trace
        if trace is not None:
            trace.contracts.entering_schedule(self, len(self.kvwarm_in_flight))
        if sweep is not None:
            mark = _progress(sweep)
            self._drive(self._sweep_step)
            self.kvwarm_sweep_moved |= mark != _progress(sweep)
        measuring = sweep.measuring() if sweep is not None and not sweep.done else None
        output, stock_start, stock_end = self._schedule_only(measuring, clock, *args, **kwargs)
        if self.kvwarm_injector.has_pending():
            self._drive(self.kvwarm_injector.admit_pending, self, output)
        note = None
        if trace is not None:
            held = sweep is not None and sweep.may_run_own_requests()
            # what waits is read only for a step the trace keeps (held or empty ones are not)
            traced = not held and output.total_num_scheduled_tokens
            queues = [getattr(self, name) for name in self.kvwarm_queues] if traced else ()
            note = trace.scheduled(self, output, held, queues, enter)
        if timer is not None:
            timing = timer.schedule_done(enter, stock_start, stock_end, clock())
            if trace is not None and len(self.kvwarm_in_flight) >= MAX_IN_FLIGHT:
                trace.contracts.lost()  # the oldest is dropped: it never reached its update
            self.kvwarm_in_flight.add(Scheduled(output, timing, note))
        return output

    def _schedule_only(self, allowed: set[str] | None, clock, *args, **kwargs):
        """Stock scheduling, with `clock`'s readings around it; with `allowed`, of those
        requests alone (running or waiting): every other one is kept out of this step, in
        its place in its queue (where there is none, nothing is moved: the filter costs a
        scan of the scheduler's requests)."""
        if allowed is not None and not self._holds_others(allowed):
            allowed = None
        if allowed is None:
            return self._stock_schedule(clock, *args, **kwargs)
        held_running = [r for r in self.running if r.request_id not in allowed]
        self.running = [r for r in self.running if r.request_id in allowed]
        held = {}
        for name in self.kvwarm_queues:
            mine, others = create_request_queue(self.policy), create_request_queue(self.policy)
            for request in getattr(self, name):
                (mine if request.request_id in allowed else others).add_request(request)
            held[name] = others
            setattr(self, name, mine)
        try:
            return self._stock_schedule(clock, *args, **kwargs)
        finally:
            self.running = self.running + held_running
            for name, queue in held.items():  # what is still queued here (a preemption) goes first
                for request in reversed(list(getattr(self, name))):
                    queue.prepend_request(request)
                setattr(self, name, queue)

    def _stock_schedule(self, clock, *args, **kwargs):
        # The lone-request budget counts the requests this call sees (after the filter): a
        # continuation's lead step beside held shadows is one eligible request to vLLM.
        with lone_prefill_budget(self):  # a no-op unless a chunk cap is applied
            start = clock() if clock else 0.0
            output = super().schedule(*args, **kwargs)
            return output, start, clock() if clock else 0.0

    def _holds_others(self, allowed: set[str]) -> bool:
        """Whether a request other than `allowed` is running or waiting."""
        waiting = any(r.request_id not in allowed for name in self.kvwarm_queues for r in getattr(self, name))
        return waiting or any(r.request_id not in allowed for r in self.running)

    def update_from_output(self, scheduler_output, model_runner_output):
        sweep, timer = self._live_sweep(), self._step_timer()
        if timer is None:
            return super().update_from_output(scheduler_output, model_runner_output)
        start = timer.clock()
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        end = timer.clock()
        trace = self.kvwarm_trace
        oldest = trace is not None and self.kvwarm_in_flight.oldest() is scheduler_output
        scheduled = self.kvwarm_in_flight.take(scheduler_output)
        timer.update_started(start, model_runner_output)
        window = timer.update_done(scheduled.timing if scheduled else None, end)
        moved, self.kvwarm_sweep_moved = self.kvwarm_sweep_moved, False  # of the window just closed
        if sweep is not None:
            mark = _progress(sweep)
            self._drive(sweep.after_update, self, scheduler_output, window)
            self.kvwarm_sweep_moved = mark != _progress(sweep)  # in the window opening now
        if trace is not None:
            trace.contracts.taken(scheduler_output, scheduled is not None, oldest)
            note = scheduled.trace if scheduled else None
            in_flight = len(self.kvwarm_in_flight)
            has_requests = self.has_requests()
            trace.updated(
                scheduler_output, note, model_runner_output, outputs, timer, window, end, has_requests, in_flight, moved
            )
        if sweep is not None or trace is not None:
            timer.sweep_work(timer.clock() - end)
        return outputs

    def has_requests(self) -> bool:
        # Queued shadows and a running sweep need schedule() calls even when nothing else
        # is waiting (parked chains are not in `running`); without this the engine idles.
        sweeping = self.kvwarm_sweep is not None and self.kvwarm_sweep.has_work()
        return super().has_requests() or self.kvwarm_injector.has_pending() or sweeping

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self.kvwarm_trace is not None:  # what is pending written, the file closed
                self.kvwarm_trace.close()


def _progress(sweep) -> tuple:
    """Where a sweep stands: its phase and rows (a hook that moves either did the work between
    points: a meeting's callback, a finished point's collection and artifact write)."""
    return sweep.phase, len(sweep.rows)


class KvWarmScheduler(KvWarmSchedulerMixin, Scheduler):
    pass


class KvWarmAsyncScheduler(KvWarmSchedulerMixin, AsyncScheduler):
    pass
