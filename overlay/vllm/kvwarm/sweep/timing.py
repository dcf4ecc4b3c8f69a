"""What a step's time was spent on. The adapter reports its clock readings around vLLM's own
schedule() and update_from_output(); what the timer read of a schedule() (`Scheduling`) the
adapter keeps with the SchedulerOutput it made (sweep.in_flight) and hands back with that
output's update (the same object reaches both calls, whichever engine loop runs).

A window is the time between two consecutive update ends (a decode step as the sweep times
it), split into the vocabulary's phases:

  schedule  vLLM's own schedule() (the stock call only, not the adapter around it)
  forward   from the end of the last schedule() of the window to the start of
            update_from_output: what the host waits for the executor (model and sampler)
  update    vLLM's own update_from_output()
  sweep     what the sweep and the adapter did in the window (their hooks, the point's
            request filter, the admission): the part of the step that is ours
  other     the rest of the window: the engine loop between steps, output processing

so that schedule + forward + update + sweep + other = the window's wall, under either loop.
One step at a time (EngineCore.step) the window holds its own step's schedule(). Under vLLM's
batch queue (EngineCore.step_with_batch_queue, async scheduling) the loop schedules and submits
step n+1 before it takes step n's output in, so the window that step n's update closes holds
step n+1's schedule() (which runs while the executor works on step n), and `forward` is what
the host still waits after it.

A step's own span runs from the entry of the schedule() that scheduled it to the end of its
update_from_output (Window.span): its schedule and sweep phases are that schedule() call's,
its forward runs from that call's end to the model output's arrival (the update's start),
and its update is its own; other is 0. Under one step at a time it lies inside the window
its update closes; under the batch queue it begins before that window does. A prefill shot's
time is its span's forward.

Both carry the graph the model runner says that step ran in (`observed_graph`: its output's
`cudagraph_stats`, probed, where the release has the field and the runner filled it), or why
it is not known.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from ..record.vocabulary import PHASES

NO_FIELD = "the release's ModelRunnerOutput has no cudagraph_stats"
NOT_FILLED = "the model runner reported no cudagraph_stats (vLLM fills them only with --cudagraph-metrics)"
NOT_REPORTED = "the step's model output did not reach the sweep's timer"


def observed_graph(runner_output) -> tuple[list | None, str | None]:
    """The graph the model runner says its step ran in, [mode, padded tokens] (its output's
    `cudagraph_stats`: runtime_mode, num_padded_tokens), or None and why not."""
    if runner_output is None:
        return None, NOT_REPORTED
    stats = getattr(runner_output, "cudagraph_stats", NO_FIELD)
    if stats is NO_FIELD:
        return None, NO_FIELD
    if stats is None:
        return None, NOT_FILLED
    mode = getattr(stats, "runtime_mode", None)
    padded = getattr(stats, "num_padded_tokens", None)
    return [
        None if mode is None else str(getattr(mode, "name", mode)),
        padded if isinstance(padded, int) else None,
    ], None


@dataclass
class Window:
    """One closed window: its wall time and its phases, in seconds; `span`: the step whose
    update closed it, over its own span (None where its schedule() was not reported)."""

    wall: float
    phases: dict[str, float]
    span: Window | None = None
    graph: list | None = None  # [mode, padded tokens] the runner reported for the step (observed_graph)
    graph_why: str | None = NOT_REPORTED  # why `graph` is None


@dataclass(frozen=True)
class Scheduling:
    """What a timer read of one schedule() call: its entry, vLLM's own part and its exit. The
    adapter keeps it with the output until that output's update (sweep.in_flight)."""

    enter: float
    stock: float  # vLLM's own schedule()
    leave: float
    timer: StepTimer  # the timer that read it: only its readings make a span of its own


class StepTimer:
    """The windows and spans of the steps the adapter reports (above). `closed`: a list here
    keeps every closed window (benchmarks)."""

    def __init__(self, clock: Callable[[], float], closed: list[Window] | None = None):
        self.clock = clock
        self.closed = closed
        # the last update's step over its own span, also where no window closed (the first)
        self.last_span: Window | None = None
        self._end: float | None = None  # the last update's end: the open window's start
        self._acc = {"schedule": 0.0, "sweep": 0.0}
        self._schedule_exit: float | None = None
        self._update_start: float | None = None
        self._graph: tuple[list | None, str | None] = (None, NOT_REPORTED)  # the update's (update_started)

    def schedule_done(self, enter: float, stock_start: float, stock_end: float, leave: float) -> Scheduling:
        """A schedule() ran from `enter` to `leave`, vLLM's own part from stock_start to
        stock_end: what the adapter hands back with its output's update (update_done)."""
        stock = stock_end - stock_start
        self._acc["schedule"] += stock
        self._acc["sweep"] += (leave - enter) - stock
        self._schedule_exit = leave
        return Scheduling(enter, stock, leave, self)

    def update_started(self, at: float, runner_output=None) -> None:
        """update_from_output starts taking in `runner_output` (the step's ModelRunnerOutput,
        whose graph the window and span it closes carry)."""
        self._update_start = at
        self._graph = observed_graph(runner_output)

    def update_done(self, scheduled: Scheduling | None, at: float) -> Window | None:
        """update_from_output took in the output that `scheduled` made and ended at `at`: the
        window since the last update's end closes (None for the first, which has no start).
        `scheduled` is None where the adapter did not see that output scheduled; one another
        timer read (the adapter swaps its timer when a sweep ends) gives no span here either."""
        start, self._end = self._end, at
        acc, exit_, update_start = self._acc, self._schedule_exit, self._update_start
        self._acc = dict.fromkeys(acc, 0.0)
        self._schedule_exit = None
        known = scheduled is not None and scheduled.timer is self and update_start is not None
        graph, why = self._graph
        self._graph = (None, NOT_REPORTED)
        self.last_span = _span(scheduled, update_start, at) if known else None
        if self.last_span is not None:
            self.last_span.graph, self.last_span.graph_why = graph, why
        if start is None or update_start is None:
            return None
        update = at - update_start
        forward = max(0.0, update_start - exit_) if exit_ is not None and exit_ >= start else 0.0
        wall = at - start
        phases = {"schedule": acc["schedule"], "forward": forward, "update": update, "sweep": acc["sweep"]}
        phases["other"] = max(0.0, wall - sum(phases.values()))
        window = Window(wall, phases, self.last_span, graph, why)
        if self.closed is not None:
            self.closed.append(window)
        return window

    def sweep_work(self, seconds: float) -> None:
        """Time the sweep spent in the open window outside schedule() (its after_update)."""
        self._acc["sweep"] += seconds


def _span(scheduled: Scheduling, update_start: float, update_end: float) -> Window:
    ours = (scheduled.leave - scheduled.enter) - scheduled.stock
    phases = {
        "schedule": scheduled.stock,
        "forward": max(0.0, update_start - scheduled.leave),
        "update": update_end - update_start,
        "sweep": ours,
        "other": 0.0,
    }
    return Window(update_end - scheduled.enter, phases)


def phase_medians(windows: list[Window]) -> dict[str, float] | None:
    """The median of each phase over a point's timed windows (None without any)."""
    if not windows:
        return None
    return {phase: statistics.median(w.phases[phase] for w in windows) for phase in PHASES}
