"""The prefill (and mixed) points of a sweep, a collaborator the controller (sweep.controller)
holds and calls: it starts a point's runner once the ranks met (sweep.prefill_runner,
sweep.mixed_runner), queues its shots one per step and hands back the point's row once the
runner is done. In exact state a mixed point's decode part first gets its catch-ups, as a
decode point does (sweep.catchups): `start` hands them back for the controller to park, the
ranks meet, then `caught_up` starts the runner on them.

The controller alone sets its phase, its rows, its collector's hold and its meetings, and
decides a restage; this asks what it needs of the controller's state as `PointInputs`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kv.injector import Admission
from ..record import vocabulary as v
from ..record.artifact import PointRow
from .catchups import CatchUps, catchup_admission, start_catchups
from .mixed_runner import MixedRunner, skipped_mixed_row
from .plan import PointPlan, SweepConfig, injected_contexts
from .points import mixed_advance, mixed_decode_steps
from .prefill import TailText, prefixes_missing
from .prefill_runner import Next, PrefillRunner
from .timing import Window


@dataclass(frozen=True)
class PointInputs:
    """What a prefill or mixed point starts from, as the controller holds it."""

    chains: list  # the rung's chains
    index: int  # the point's index; with the sweep's number, in its requests' ids
    number: int  # the sweep's number
    config: SweepConfig
    tails: TailText  # text the chains never use, for the shots' new tokens
    drifted: set[str]  # the chains an in-place shadow has advanced (sweep.rows.state_reasons)


class PrefillPoints:
    def __init__(self, ranks: int):
        """`ranks`: the data-parallel ranks measuring every point."""
        self.ranks = ranks
        self._runner: PrefillRunner | MixedRunner | None = None  # the point being measured

    @property
    def running(self) -> bool:
        return self._runner is not None

    def must_restage(self, scheduler, plan: PointPlan, chains: list) -> bool:
        """Whether a real-prefix point, not yet retried, finds a prefix of its own no longer
        cached on this rank: then every rank builds its chains again before it starts."""
        return bool(plan.prefill and plan.real and not plan.retried and prefixes_missing(scheduler, plan.point, chains))

    def start(
        self, scheduler, plan: PointPlan, inputs: PointInputs, admission: Admission | None = None
    ) -> CatchUps | None:
        """Start measuring the point: its runner starts, and `next_shot` queues its warm shot
        next (None). A mixed point on real KV in exact state without its decode part's
        `admission` first needs catch-ups: they are added and handed back, for the controller
        to park; `caught_up` starts the runner on them."""
        config = inputs.config
        if plan.mixed and plan.real and config.state_mode == v.EXACT and admission is None:
            decode = plan.point.decode
            contexts = injected_contexts(decode, mixed_advance(plan.point, config.settle_steps, self.ranks))
            steps, name = mixed_decode_steps(config.decode_steps), f"catchup{inputs.index}_s{inputs.number}"
            return start_catchups(scheduler, plan, inputs.chains[: decode.batch_size], contexts, steps, config, name)
        ids = (inputs.index, inputs.number)
        if plan.mixed:
            self._runner = MixedRunner(
                scheduler, plan, inputs.chains, inputs.tails, config, ids, inputs.drifted, admission, self.ranks
            )
        else:
            trailing = 1 if self.ranks > 1 else 0  # ranks a step apart (sweep.prefill_runner)
            self._runner = PrefillRunner(
                scheduler, plan, inputs.chains, inputs.tails, config.steady_steps, ids, trailing, config.settle_steps
            )
        return None

    def caught_up(self, scheduler, catchups: CatchUps, inputs: PointInputs) -> PointRow | None:
        """A mixed point's catch-ups are parked on every rank: its runner starts on them
        (None), or its row, skipped by name, where they did not fit (as a decode point's)."""
        plan = catchups.plan
        if catchups.short:
            return skipped_mixed_row(plan.point, v.POINT_SKIP_REASON, catchups.short)
        chains = inputs.chains[: plan.point.decode.batch_size]
        self.start(scheduler, plan, inputs, catchup_admission(catchups, chains, inputs.config))
        return None

    def current_ids(self) -> set[str] | None:
        """The ids of the requests a step may run while a point is measured (None: none is)."""
        return None if self._runner is None else self._runner.current_ids()

    def next_shot(self, scheduler) -> PointRow | None:
        """At a schedule(): the runner's next shot is queued where it is due; once every shot
        ran (or the point failed) its requests are ended and the point's row handed back."""
        if self._runner.next_shot(scheduler) is not Next.DONE:
            return None
        runner, self._runner = self._runner, None
        return runner.finish(scheduler)

    def step(self, output, window: Window | None) -> None:
        """After a step: the runner checks and times the shot it ran, if any."""
        self._runner.step(output, window)

    def abandon(self, scheduler) -> list[str]:
        """The sweep stops: the point's prefixes and the engine's chunk size are given back;
        the ids of the requests the point queued, for the controller to end."""
        if self._runner is None:
            return []
        runner, self._runner = self._runner, None
        ids = runner.request_ids()
        runner.release(scheduler)
        return ids
