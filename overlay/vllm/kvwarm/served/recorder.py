"""The served-step trace: every step the engine runs outside a sweep, one JSON line
(docs/validate-reference.md#the-trace; the format's words are record.vocabulary's TRACE_*).

The adapter calls `scheduled()` at the end of each schedule() and `updated()` after each
update_from_output(); what `scheduled()` notes of a step the adapter keeps with its output
until that output's update, in the one record of the steps in flight that the step timer's
readings share (sweep.in_flight). In the step they take plain data (the parts of the SchedulerOutput a
line reads, what the queues hold, the window the adapter's StepTimer closed, how many
request outputs the step sent) and hand it, marshalled, to the trace's writer process
(served.writer, served.sink), which keeps the prompt lengths, renders the lines and writes
the files: nothing of vLLM's is kept past the step and no thread of the trace's runs in the
engine's process. A step is traced when it scheduled tokens and the sweep, where one is
configured, held none of its own requests in it (Sweep.may_run_own_requests); its number
counts traced steps. Its `wall` is the window the timer closed (one update end to the next:
a decode row's basis), null where the window holds an idle wait: the engine had no request
and no step in flight when the previous window closed, so it waited for work before this
step (a rank's first step has no window either); null too, with the reason in `untimed`,
where the window holds the sweep's work between points or the output was not seen scheduled
(served.contracts). Its `gap`: the last update end before its schedule() to that schedule()'s
entry. Its `span` is its own schedule() entry to its update end (what Dynamo's FPM falls back
to after an idle wait). Its `gc`: the collections Python's collector ran in the window, in
any thread, and their time (a served engine collects as it goes; a sweep holds its collector
still in timed steps). All times are on one clock, the adapter's: `at` counts from its reading
when the trace started.
"""

from __future__ import annotations

import atexit
import gc
import os
import time
from datetime import UTC, datetime

from vllm.logger import init_logger

from ..record import vocabulary as v
from ..sweep.provenance import loop_record, rank_layout, run_record
from .contracts import Contracts
from .settings import TraceSettings
from .sink import line
from .step_parts import NOTHING_WAITS, graph, parts, waiting
from .writer import TraceWriter

logger = init_logger(__name__)


def trace_header(scheduler, settings: TraceSettings, started: datetime) -> dict:
    """The header: what the sweep's artifact records about a run (same code), and the loop."""
    vllm_config = scheduler.vllm_config
    layout = rank_layout(vllm_config.parallel_config)
    record = run_record(scheduler)
    return {
        "type": v.TRACE_TYPE,
        "schema_version": v.TRACE_SCHEMA_VERSION,
        "rank": layout.data_parallel_rank,
        "dp_size": layout.data_parallel_size,
        "started_at": started.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "model": vllm_config.model_config.model,
        "build": record["build"],
        "engine": record["engine_args"],
        "layout": layout.as_dict(),
        "hardware": record["hardware"],
        "torch": record["torch"],
        "engine_loop": loop_record(scheduler),
        "log_stats": bool(getattr(scheduler, "log_stats", False)),
        "timing": {"basis": v.TRACE_BASIS, "clock": v.TRACE_CLOCK},
        "bounds": {"max_file_bytes": settings.max_file_bytes, "files": settings.files},
    }


class TraceRecorder:
    def __init__(self, scheduler, settings: TraceSettings, clock=time.perf_counter):
        """`clock`: the adapter's, which its step timers read too."""
        from vllm.v1.request import RequestStatus

        self.clock = clock
        started = datetime.now(UTC)
        self.origin = clock()  # the header's started_at on `clock`: a step's `at` counts from here
        header = trace_header(scheduler, settings, started)
        self.rank = header["rank"]
        self.launch = v.trace_launch(started, os.getpid())
        self._preempted = RequestStatus.PREEMPTED
        self.writer = TraceWriter(settings, self.rank, self.launch, line(header))
        self.path = self.writer.path
        self.contracts = Contracts(header["engine_loop"]["loop"] == v.LOOP_SYNC)
        self.unknown = 0  # outputs taken in that were not seen scheduled (H1, H2)
        self._failed = False  # a hook failed (logged once); the trace goes on with the next step
        self._count = 0  # traced steps so far
        self._idle = True  # the last window closed with nothing to do (and the first has no start)
        self._last_end: float | None = None  # the last update's end: where the next step's gap starts
        self._gc = [0, 0.0, 0.0]  # collections and their seconds since the last update; the open one's start
        gc.callbacks.append(self._collected)
        atexit.register(self.close)

    def _collected(self, phase: str, info: dict) -> None:
        """Python's collector calls this around every collection, in whichever thread runs it."""
        if phase == "start":
            self._gc[2] = time.perf_counter()
        else:
            self._gc[0] += 1
            self._gc[1] += time.perf_counter() - self._gc[2]

    # --- in the step (the engine's thread): plain data, handed to the writer process ----------

    def scheduled(self, scheduler, output, held: bool, queued, enter: float) -> tuple:
        """`scheduler`'s schedule(), entered at `enter`, made `output`; `held`: the sweep's own
        requests may be in it; `queued`: the scheduler's queues after it (none where the step
        is not traced). The step's note, for `updated`: (held, what waits, its gap)."""
        gap = None if self._last_end is None else enter - self._last_end
        try:
            if not held:
                self.contracts.scheduled(scheduler, output)
            return held, waiting(queued, self._preempted), gap
        except Exception:  # noqa: BLE001  (a failure here must never reach the engine)
            self._hook_failed()
            return held, NOTHING_WAITS, gap

    def updated(
        self,
        output,
        note,
        runner_output,
        engine_outputs,
        timer,
        window,
        end: float,
        has_requests: bool,
        in_flight: int,
        sweep_work: bool,
    ) -> None:
        """update_from_output took `output` in, ended at `end` (the adapter's clock) and
        returned `engine_outputs`; `note`: what `scheduled` gave for it (None: the adapter did
        not see it scheduled, H1 or H2 broken: traced with a null wall); `window`: what `timer`
        closed; `has_requests`: the scheduler's, after; `in_flight`: the steps still scheduled
        and not taken in; `sweep_work`: the window holds the sweep's work between points."""
        try:
            self._last_end = end
            untimed = v.TRACE_UNTIMED_SWEEP if sweep_work else None
            if note is None:  # said by the contracts' check (H1, H2)
                self.unknown += 1
                note, untimed = (False, NOTHING_WAITS, None), v.TRACE_UNTIMED_UNKNOWN
            held, waits, gap = note
            waited, self._idle = self._idle, not has_requests and not in_flight
            collected, self._gc = self._gc, [0, 0.0, self._gc[2]]
            at = end - self.origin
            if held or not output.total_num_scheduled_tokens:  # read for the prompt lengths alone
                step = (None, None, None, None, None, None, None, parts(output), waits, 0, None, None)
            else:
                number, self._count = self._count, self._count + 1
                span = timer.last_span
                stats = getattr(runner_output, "cudagraph_stats", None)
                step = (
                    number,
                    at,
                    None if waited or window is None or untimed else window.wall,
                    untimed,
                    gap,
                    span.wall if span is not None else None,
                    window.phases if window is not None else {},
                    parts(output),
                    waits,
                    sum(len(e.outputs) for e in engine_outputs.values()) if engine_outputs else 0,
                    collected[:2],
                    graph(stats),
                )
            self.writer.submit(step, at, self._idle)
        except Exception:  # noqa: BLE001  (a failure here must never reach the engine)
            self._hook_failed()

    def _hook_failed(self) -> None:
        if not self._failed:
            self._failed = True
            logger.exception("[kvwarm trace] a step could not be read; it is left out, the engine serves on")

    def close(self) -> None:
        if self._collected in gc.callbacks:
            gc.callbacks.remove(self._collected)
        self.writer.close()
