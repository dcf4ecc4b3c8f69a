"""One record per SchedulerOutput in flight, from the schedule() that made it to the
update_from_output() that takes it in: what the step timer read of that schedule()
(sweep.timing.Scheduling) and what the served trace noted then (served.recorder). The adapter
holds it, not a timer: it swaps its timer between the two calls when a sweep ends, and the
trace's note must reach the update all the same.

Steps scheduled and not yet taken in are at most the batch queue's depth (the pipeline
stages, plus one under async scheduling); the record keeps MAX_IN_FLIGHT, dropping the
oldest, for an output that never reaches update_from_output (the engine stopped).
"""

from __future__ import annotations

from dataclasses import dataclass

from .timing import Scheduling

MAX_IN_FLIGHT = 16


@dataclass(frozen=True)
class Scheduled:
    output: object  # the SchedulerOutput, held so that its id is not reused while in flight
    timing: Scheduling
    trace: tuple | None = None  # the trace's note of the step (None: no trace, or its hook failed)


class InFlight:
    """The outputs scheduled and not yet taken in, by identity."""

    def __init__(self):
        self._by_output: dict[int, Scheduled] = {}

    def add(self, scheduled: Scheduled) -> None:
        if len(self._by_output) >= MAX_IN_FLIGHT:
            del self._by_output[next(iter(self._by_output))]
        self._by_output[id(scheduled.output)] = scheduled

    def oldest(self):
        """The output scheduled first of those in flight (None: none)."""
        first = next(iter(self._by_output.values()), None)
        return first.output if first is not None else None

    def take(self, output) -> Scheduled | None:
        """The record of `output`, no longer in flight (None where it was never added, or dropped)."""
        return self._by_output.pop(id(output), None)

    def __len__(self) -> int:
        return len(self._by_output)
