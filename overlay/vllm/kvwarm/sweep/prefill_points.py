"""The prefill (and mixed) points of a sweep's controller (sweep.controller.Sweep takes these methods):
a point's runner started once the ranks met (sweep.prefill_runner), its shots queued one per
step, and a restage every rank takes part in (decided at the point's meeting). In exact state a
mixed point's decode part first gets its catch-ups, as a decode point does (sweep.catchups):
the controller prefills and parks them, the ranks meet, then the runner starts on them."""

from __future__ import annotations

from ..kv.injector import Admission
from ..record import vocabulary as v
from .catchups import CatchUps, catchup_admission, start_catchups
from .mixed_runner import MixedRunner, skipped_mixed_row
from .phase import Phase
from .plan import PointPlan, injected_contexts
from .points import mixed_advance, mixed_decode_steps
from .prefill_runner import Next, PrefillRunner


class PrefillPoints:
    def _start_prefill(self, scheduler, plan: PointPlan, admission: Admission | None = None) -> None:
        """The point's prefixes, then its warm shot; the measured shots follow one per step
        (a mixed point's beside its decode part's shadows, once they are admitted; in exact
        state once its catch-ups are parked: `admission`, their shadows)."""
        config = self.config
        if plan.mixed and plan.real and config.state_mode == v.EXACT and admission is None:
            decode = plan.point.decode
            chains = self._rung.chains[: decode.batch_size]
            steps = mixed_decode_steps(config.decode_steps)
            name = f"catchup{len(self.rows)}_s{self._number}"
            ranks = self._meetings.exchange.size
            contexts = injected_contexts(decode, mixed_advance(plan.point, config.settle_steps, ranks))
            self._catchups = start_catchups(scheduler, plan, chains, contexts, steps, config, name)
            self.phase = Phase.CATCHING_UP
            return
        ids = (len(self.rows), self._number)
        if plan.mixed:
            chains = self._rung.chains
            ranks = self._meetings.exchange.size
            self._prefill = MixedRunner(
                scheduler, plan, chains, self._tails, config, ids, self._drifted, admission, ranks
            )
        else:
            trailing = 1 if self._meetings.exchange.size > 1 else 0  # ranks a step apart (sweep.prefill_runner)
            self._prefill = PrefillRunner(
                scheduler, plan, self._rung.chains, self._tails, config.steady_steps, ids, trailing, config.settle_steps
            )
        self._gc.hold()
        self.phase = Phase.MEASURING
        self._next_shot(scheduler)

    def _mixed_caught_up(self, scheduler, catchups: CatchUps) -> None:
        """Every rank's catch-ups are parked: the point's runner starts on them, or the point
        is skipped where they did not fit (named, as a decode point's)."""
        plan = catchups.plan
        if catchups.short:
            self._finish_point(skipped_mixed_row(plan.point, v.POINT_SKIP_REASON, catchups.short), scheduler)
            return
        chains = self._rung.chains[: plan.point.decode.batch_size]
        self._start_prefill(scheduler, plan, catchup_admission(catchups, chains, self.config))

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
