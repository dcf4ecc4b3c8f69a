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
step (a rank's first step has no window either). Its `span` is its own schedule() entry to
its update end (what Dynamo's FPM falls back to after an idle wait). Its `gc`: the
collections Python's collector ran in the window, in any thread, and their time (a served
engine collects as it goes; a sweep holds its collector still in timed steps).
"""

from __future__ import annotations

import atexit
import gc
import time
from datetime import UTC, datetime

from vllm.logger import init_logger

from ..record import vocabulary as v
from ..sweep.provenance import loop_record, rank_layout, run_record
from .settings import TraceSettings
from .sink import line
from .step_parts import graph, parts, waiting
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
        from vllm.v1.request import RequestStatus

        self.clock = clock
        started = datetime.now(UTC)
        self._t0 = clock()
        header = trace_header(scheduler, settings, started)
        self.rank = header["rank"]
        self._preempted = RequestStatus.PREEMPTED
        self.writer = TraceWriter(settings.out, self.rank, line(header), settings.max_file_bytes, settings.files)
        self.path = self.writer.path
        self._failed = False  # a hook failed (logged once); the trace goes on with the next step
        self._count = 0  # traced steps so far
        self._idle = True  # the last window closed with nothing to do (and the first has no start)
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

    def scheduled(self, output, held: bool, queued: tuple) -> tuple | None:
        """schedule() made `output`; `held`: the sweep's own requests may be in it; `queued`:
        the scheduler's queues after it (none where the step is not traced). The step's note,
        for `updated` (None where it could not be read)."""
        try:
            return held, waiting(queued, self._preempted)
        except Exception:  # noqa: BLE001  (a failure here must never reach the engine)
            self._hook_failed()
            return None

    def updated(
        self, output, note, runner_output, engine_outputs, timer, window, end: float, has_requests: bool, in_flight: int
    ) -> None:
        """update_from_output took `output` in, ended at `end` (the timer's clock) and returned
        `engine_outputs`; `note`: what `scheduled` gave for it (None: not seen scheduled, which
        counts as held); `window`: what `timer` closed; `has_requests`: the scheduler's, after;
        `in_flight`: the steps still scheduled and not taken in."""
        try:
            held, waits = note if note is not None else (True, ((), ()))
            waited, self._idle = self._idle, not has_requests and not in_flight
            collected, self._gc = self._gc, [0, 0.0, self._gc[2]]
            if held or not output.total_num_scheduled_tokens:  # read for the prompt lengths alone
                step = (None, None, None, None, None, parts(output), waits, 0, None, None)
            else:
                number, self._count = self._count, self._count + 1
                span = timer.last_span
                stats = getattr(runner_output, "cudagraph_stats", None)
                step = (
                    number,
                    end - self._t0,
                    None if waited or window is None else window.wall,
                    span.wall if span is not None else None,
                    window.phases if window is not None else {},
                    parts(output),
                    waits,
                    sum(len(e.outputs) for e in engine_outputs.values()) if engine_outputs else 0,
                    collected[:2],
                    graph(stats),
                )
            self.writer.submit(step, end, self._idle)
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
