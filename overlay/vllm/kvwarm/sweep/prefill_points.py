"""The prefill (and mixed) points of a sweep's controller (sweep.controller.Sweep takes these methods):
a point's runner started once the ranks met (sweep.prefill_runner), its shots queued one per
step, and a restage every rank takes part in (decided at the point's meeting)."""

from __future__ import annotations

from .mixed_runner import MixedRunner
from .phase import Phase
from .plan import PointPlan
from .prefill_runner import Next, PrefillRunner


class PrefillPoints:
    def _start_prefill(self, scheduler, plan: PointPlan) -> None:
        """The point's prefixes, then its warm shot; the measured shots follow one per step
        (a mixed point's beside its decode part's shadows, once they are admitted)."""
        ids = (len(self.rows), self._number)
        if plan.mixed:  # at one rank (sweep.limits): no trailing shots
            self._prefill = MixedRunner(scheduler, plan, self._rung.chains, self._tails, self.config, ids)
        else:
            trailing = 1 if self._meetings.exchange.size > 1 else 0  # ranks a step apart (sweep.prefill_runner)
            self._prefill = PrefillRunner(
                scheduler, plan, self._rung.chains, self._tails, self.config.steady_steps, ids, trailing
            )
        self._gc.hold()
        self.phase = Phase.MEASURING
        self._next_shot(scheduler)

    def _next_shot(self, scheduler) -> None:
        if self._prefill.next_shot(scheduler) is Next.DONE:
            runner, self._prefill = self._prefill, None
            self._finish_point(runner.finish(scheduler), scheduler)

    def _restage(self, scheduler, plan: PointPlan, asked: list[int]) -> None:
        """A rank (`asked`) found a prefix of the point no longer cached: every rank builds its
        rung's chains again, once, and the point meets again (its prefixes are not asked
        again: a prefix still missing then fails the point)."""
        from vllm.v1.request import RequestStatus

        plan.retried = True
        self._progress(
            f"prefill point N={plan.point.total_prefill_tokens} P={plan.point.total_kv_read_tokens}: "
            f"a chain's prefix was not cached on rank(s) {asked}; building the chains again"
        )
        self._restaging = plan
        scheduler.finish_requests([c.request_id for c in self._rung.chains], RequestStatus.FINISHED_ABORTED)
        self._rung.chains = []
        self._rung.started = self.clock()
        self._add_chains(scheduler, self._rung)
