"""What the trace and the step timer rely on of vLLM's behaviour, checked as the engine runs
(docs/hooks.md, "The served-step trace": H1 to H6). A release that breaks one is said once,
by name, with what it costs the trace, instead of the trace going quietly wrong. Every check
is O(1) per step: none walks the queues or the requests.

  H1  the object schedule() returns is the one update_from_output takes
  H2  every scheduled output reaches update_from_output, exactly once
  H3  the engine steps only while has_requests() or a step is in flight (so it waits for work
      only when neither holds: the idle rule behind a null `wall`)
  H4  CachedRequestData.num_computed_tokens is a request's count before the step
  H5  the outputs reach update_from_output in the order schedule() made them; one step at a
      time there is never a second in flight (under the batch queue step n+1's schedule()
      runs before step n's update)
  H6  the waiting queues are the scheduler's RequestQueue attributes when the adapter is made
"""

from __future__ import annotations

import functools

from vllm.logger import init_logger
from vllm.v1.core.sched.request_queue import RequestQueue

from ..record import vocabulary as v

logger = init_logger(__name__)

CONTRACTS = {
    "H1": "the object schedule() returns is the one update_from_output takes",
    "H2": "every scheduled output reaches update_from_output, exactly once",
    "H3": "the engine steps only while has_requests() or a step is in flight",
    "H4": "CachedRequestData.num_computed_tokens is the count before the step",
    "H5": "outputs reach update_from_output in the order schedule() made them",
    "H6": "the waiting queues are the RequestQueue attributes found when the adapter is made",
}
QUEUES_EVERY = 1024  # H6 looks at the scheduler's attributes at the first schedule() and every this many


def _guarded(check):
    """A check whose own failure never reaches the engine: said once, and the checks stop."""

    @functools.wraps(check)
    def run(self, *args) -> None:
        if self.failed:
            return
        try:
            check(self, *args)
        except Exception:
            self.failed = True
            logger.exception("[kvwarm trace] a check of docs/hooks.md's contracts failed; the checks stop here")

    return run


class Contracts:
    """The checks; `broken`: how often each contract was seen broken."""

    def __init__(self, one_at_a_time: bool):
        """`one_at_a_time`: the engine's loop is EngineCore.step (sweep.provenance.engine_loop)."""
        self.one_at_a_time = one_at_a_time
        self.broken: dict[str, int] = {}
        self.failed = False
        self._schedules = 0
        self._last_taken = None  # the output update_from_output took last (H2: taken twice)

    def say(self, name: str, what: str, cost: str) -> None:
        """Contract `name` broken: counted, and said the first time only."""
        self.broken[name] = self.broken.get(name, 0) + 1
        if self.broken[name] == 1:
            logger.warning(
                "[kvwarm trace] docs/hooks.md %s (%s) does not hold on this vLLM: %s; %s. Said once; please report it",
                name,
                CONTRACTS[name],
                what,
                cost,
            )

    # --- at schedule()'s entry and exit ---------------------------------------------------

    @_guarded
    def entering_schedule(self, scheduler, in_flight: int) -> None:
        if not in_flight and not scheduler.has_requests():
            self.say("H3", "schedule() ran with no request and no step in flight", "a null wall may be a step's own")
        if self.one_at_a_time and in_flight:
            self.say(
                "H5",
                f"one step at a time, schedule() ran with {in_flight} step(s) not yet taken in",
                "the windows split their phases wrongly",
            )
        if self._schedules % QUEUES_EVERY == 0:
            self._queues(scheduler)
        self._schedules += 1

    def _queues(self, scheduler) -> None:
        found = sorted(name for name, value in vars(scheduler).items() if isinstance(value, RequestQueue))
        if found != sorted(scheduler.kvwarm_queues):
            self.say(
                "H6",
                f"the waiting queues are {found}, {sorted(scheduler.kvwarm_queues)} when the adapter was made",
                "the requests of another queue are missing from `queued` and not held out of a sweep's points",
            )

    @_guarded
    def scheduled(self, scheduler, output) -> None:
        """Right after a served step's schedule(): its first cached request's count, before
        the step and as vLLM has advanced it."""
        cached = output.scheduled_cached_reqs
        if not cached.req_ids:
            return
        req_id = cached.req_ids[0]
        request = scheduler.requests.get(req_id)
        if request is None:
            return
        before, scheduled = cached.num_computed_tokens[0], output.num_scheduled_tokens.get(req_id, 0)
        if before + scheduled != request.num_computed_tokens:
            self.say(
                "H4",
                f"request {req_id}: {before} computed in its CachedRequestData and {scheduled} scheduled, but "
                f"{request.num_computed_tokens} computed after schedule()",
                "a step's decode and prefill parts and its contexts are misread",
            )

    # --- at update_from_output() --------------------------------------------------------------

    @_guarded
    def taken(self, output, known: bool, oldest: bool) -> None:
        """update_from_output took `output`: `known`, the adapter saw schedule() return it;
        `oldest`, it was the first in flight."""
        if not known:
            twice = output is self._last_taken
            self.say(
                "H2" if twice else "H1",
                "update_from_output took an output twice"
                if twice
                else "update_from_output took an output no schedule() of this adapter returned",
                f'the step is traced with a null wall ("untimed": "{v.TRACE_UNTIMED_UNKNOWN}")',
            )
        elif not oldest:
            self.say("H5", "update_from_output took an output before an older one", "the windows are misattributed")
        self._last_taken = output

    @_guarded
    def lost(self) -> None:
        """The in-flight record was full: an output never reached update_from_output."""
        self.say("H2", "a scheduled output never reached update_from_output", "its step is missing from the trace")
