"""The served-step trace: every step the engine runs outside a sweep, one JSON line
(docs/validate.md#the-trace; the format's words are record.vocabulary's TRACE_*).

The adapter calls `scheduled()` at the end of each schedule() and `updated()` after each
update_from_output(). In the step they keep references and a few numbers (the parts of the
SchedulerOutput a line reads, the queues' contents, the window the adapter's StepTimer
closed, how many request outputs the step sent); the writer's thread (served.writer) turns
them into lines later (served.shape: raw numbers; the reader composes them). A step is
traced when it scheduled tokens and the sweep, where one is configured, held none of its own
requests in it (Sweep.runs_own_requests); its number counts traced steps. Its `wall` is the
window the timer closed (one update end to the next: a decode row's basis), null where the
window holds an idle wait: the engine had no request and no step in flight when the previous
window closed, so it waited for work before this step (a rank's first step has no window
either). Its `span` is its own schedule() entry to its update end (what Dynamo's FPM falls
back to after an idle wait). Its `gc`: the collections Python's collector ran in the window,
in any thread, and their time (a served engine collects as it goes; a sweep holds its
collector still in timed steps).
"""

from __future__ import annotations

import atexit
import gc
import time
from datetime import UTC, datetime

from ..record import vocabulary as v
from ..sweep.engine_record import run_record
from ..sweep.loop import loop_record
from ..sweep.ranks import rank_layout
from .settings import TraceSettings
from .shape import RawSteps, graph, parts, queued
from .writer import TraceFiles, TraceWriter, line

MAX_IN_FLIGHT = 16  # as the StepTimer's: outputs scheduled and not yet taken in


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
        self._raw = RawSteps(scheduler.requests)
        files = TraceFiles(settings.out, self.rank, header, settings.max_file_bytes, settings.files)
        self.path = files.path
        self.writer = TraceWriter(files, self.render)
        self._scheduled: dict[int, tuple] = {}  # by id(SchedulerOutput): (held, queues after its schedule())
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

    # --- in the step (the engine's thread): references and a few numbers ---------------------

    def scheduled(self, output, held: bool, waiting: tuple) -> None:
        """schedule() made `output`; `held`: the sweep's own requests may be in it; `waiting`:
        the queues' contents it left."""
        if len(self._scheduled) >= MAX_IN_FLIGHT:
            del self._scheduled[next(iter(self._scheduled))]
        self._scheduled[id(output)] = (held, waiting)

    def updated(self, output, runner_output, engine_outputs, timer, window, end: float, has_requests: bool) -> None:
        """update_from_output took `output` in, ended at `end` (the timer's clock) and returned
        `engine_outputs`; `window`: what `timer` closed; `has_requests`: the scheduler's, after."""
        held, waiting = self._scheduled.pop(id(output), (True, ()))
        number = None
        if not held and output.total_num_scheduled_tokens:
            number, self._count = self._count, self._count + 1
        waited, self._idle = self._idle, not has_requests and not self._scheduled
        sent = sum(len(e.outputs) for e in engine_outputs.values()) if number is not None and engine_outputs else 0
        stats = getattr(runner_output, "cudagraph_stats", None)
        span = timer.last_span if number is not None else None
        collected, self._gc = self._gc, [0, 0.0, self._gc[2]]
        self.writer.submit((number, parts(output), waiting, end, window, span, waited, sent, stats, collected))

    # --- in the writer's thread ---------------------------------------------------------------

    def render(self, item) -> str | None:
        number, step_parts, waiting, end, window, span, waited, sent, stats, collected = item
        raw = self._raw.observe(step_parts)  # every step: it keeps the prompt lengths
        if number is None:
            return None
        record = {
            "step": number,
            "at": end - self._t0,
            "wall": None if waited or window is None else window.wall,
            "span": span.wall if span is not None else None,
            "phases": window.phases if window is not None else {},
            **raw,
            "queued": queued(waiting, self._preempted),
            "outputs": sent,
            "gc": collected[:2],
        }
        if stats is not None:
            record["graph"] = graph(stats)
        return line(record)

    def close(self) -> None:
        if self._collected in gc.callbacks:
            gc.callbacks.remove(self._collected)
        self.writer.close()
