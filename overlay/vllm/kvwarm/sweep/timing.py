"""What a step's time was spent on: the adapter reports its clock readings around vLLM's own
schedule() and update_from_output(), and every window between two consecutive update ends
(a decode step as the sweep times it) is split into the vocabulary's phases:

  schedule  vLLM's own schedule() (the stock call only, not the adapter around it)
  forward   from the end of the last schedule() of the window to the start of
            update_from_output: what the host waits for the executor (model and sampler)
  update    vLLM's own update_from_output()
  sweep     what the sweep and the adapter did in the window (their hooks, the point's
            request filter, the admission): the part of the step that is ours
  other     the rest of the window: the engine loop between steps, output processing

Under async scheduling the next step's schedule() runs while the executor works, so it falls
inside the window it overlaps; `forward` is then what the host still waits after it.
A prefill shot's time is its forward phase: from the end of the schedule() that scheduled it
to the model output's arrival.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from ..record.vocabulary import PHASES


@dataclass
class Window:
    """One closed window: its wall time and its phases, in seconds."""

    wall: float
    phases: dict[str, float]


@dataclass
class StepTimer:
    clock: Callable[[], float]
    closed: list[Window] | None = None  # a list here keeps every closed window (benchmarks)
    _end: float | None = None  # the last update's end: the open window's start
    _acc: dict[str, float] = field(default_factory=lambda: {"schedule": 0.0, "sweep": 0.0})
    _schedule_exit: float | None = None
    _update_start: float | None = None

    def schedule_done(self, enter: float, stock_start: float, stock_end: float, leave: float) -> None:
        """schedule() ran from `enter` to `leave`, vLLM's own part from stock_start to stock_end."""
        self._acc["schedule"] += stock_end - stock_start
        self._acc["sweep"] += (leave - enter) - (stock_end - stock_start)
        self._schedule_exit = leave

    def update_started(self, at: float) -> None:
        self._update_start = at

    def update_done(self, at: float) -> Window | None:
        """update_from_output ended at `at`: the window since the last update's end closes
        (None for the first, which has no start)."""
        start, self._end = self._end, at
        acc, exit_, update_start = self._acc, self._schedule_exit, self._update_start
        self._acc = dict.fromkeys(acc, 0.0)
        self._schedule_exit = None
        if start is None or update_start is None:
            return None
        update = at - update_start
        forward = max(0.0, update_start - exit_) if exit_ is not None and exit_ >= start else 0.0
        wall = at - start
        phases = {"schedule": acc["schedule"], "forward": forward, "update": update, "sweep": acc["sweep"]}
        phases["other"] = max(0.0, wall - sum(phases.values()))
        window = Window(wall, phases)
        if self.closed is not None:
            self.closed.append(window)
        return window

    def sweep_work(self, seconds: float) -> None:
        """Time the sweep spent in the open window outside schedule() (its after_update)."""
        self._acc["sweep"] += seconds


def phase_medians(windows: list[Window]) -> dict[str, float] | None:
    """The median of each phase over a point's timed windows (None without any)."""
    if not windows:
        return None
    return {phase: statistics.median(w.phases[phase] for w in windows) for phase in PHASES}
