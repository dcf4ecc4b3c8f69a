"""A decode point's steps once its requests are queued (sweep.controller drives it): the ids
its steps may run (its shadows, once admitted), the admission step (scaffolding, not timed),
the settle steps (SweepConfig.settle_steps: untimed, the requests admitted that many tokens
short so that the timed steps read the point's K), then each steady step's time (the window
the adapter's StepTimer closed, else the gap between consecutive update_from_output calls)
until the point's steady steps are timed, and its row.
A step that ran other than the point's B requests, one token each, skips the row
(measured_batch_size_mismatch).

Under vLLM's batch queue the window a step's update closes holds the next step's schedule()
and submission (sweep.timing), so a timed window is a served step's only where the step after
it runs the point's B requests too: the requests run one more step after the timed ones
(SweepConfig.trailing_steps), untimed but checked, and the point ends at that step's update,
when none of its requests is in flight. The first timed window starts at the admission
step's update: the admission step runs the same B requests, one token each, so the executor
is already on the first steady step.
"""

from __future__ import annotations

from collections.abc import Callable

from ..kv.injector import Admission
from ..record import vocabulary as v
from ..record.artifact import PointRow
from .plan import PointPlan, SweepConfig, settled_contexts
from .rows import measured_row, observe, skipped_row
from .timing import Window, phase_medians


def shadow_admission(scheduler, real: bool, chains: list, contexts: list[int], steps: int, config: SweepConfig):
    """The admission of a point's decode requests at `contexts`, each to run `steps` steps
    after it: shadows on `chains` on real KV, else fake-KV requests."""
    if real:
        return Admission(chains, contexts, steady_steps=steps, fork=config.fork, state_mode=config.state_mode)
    vocab = scheduler.vllm_config.model_config.get_vocab_size()
    return Admission(None, contexts, steady_steps=steps, vocab_size=vocab)


class DecodeSteps:
    def __init__(self, plan: PointPlan, admission: Admission, clock: Callable[[], float], timed: int, settle: int = 0):
        """`timed`: the steady steps timed, of the admission's, after `settle` untimed ones (the
        rest run untimed after them)."""
        self.plan, self.admission, self._clock, self._timed, self._settle = plan, admission, clock, timed, settle
        self._steps = 0  # steady steps run
        self._times: list[float] = []
        self._windows: list[Window] = []  # the timed steps' phases
        self._sampled: list[Window | None] = []  # each timed step's window (None: none closed), for its graph
        self._ids: set[str] | None = None  # the point's request ids
        self._last_update = clock()
        self._mismatch: str | None = None  # why the point's steps were not B alone

    def ids(self) -> set[str]:
        """The ids of the point's requests (empty until they are admitted)."""
        shadows = self.admission.shadows
        if self._ids is None or len(self._ids) != len(shadows):  # once per point, after admission
            self._ids = {r.request_id for r in shadows}
        return self._ids

    def step(self, output, window: Window | None) -> bool:
        """After a step: its time kept if it was a timed steady step of the point; True once
        every steady step has run."""
        ids = self.ids()
        scheduled = output.num_scheduled_tokens
        now = self._clock()
        if any(r.req_id in ids for r in output.scheduled_new_reqs):
            self._last_update = now  # the admission step: scaffolding, not timed
            return False
        if not ids & set(scheduled):
            return False
        if set(scheduled) != ids or set(scheduled.values()) != {1}:
            foreign = len(set(scheduled) - ids)
            self._mismatch = self._mismatch or (
                f"step scheduled {len(scheduled)} request(s) for a point of {len(ids)}"
                + (f", {foreign} of them not the sweep's" if foreign else "")
            )
        self._steps += 1
        if self._settle < self._steps <= self._settle + self._timed:
            self._times.append(window.wall if window is not None else now - self._last_update)
            self._sampled.append(window)
            if window is not None:
                self._windows.append(window)
        self._last_update = now
        return self._steps == self.admission.steady_steps

    def row(self, config: SweepConfig, chains: list, drifted: set[str]) -> PointRow:
        """`chains`: the requests whose state the shadows read; `drifted`: see rows.measured_row."""
        point = self.plan.point
        if self._mismatch:
            return skipped_row(point, v.BATCH_SIZE_MISMATCH, f"{v.BATCH_SIZE_MISMATCH}: {self._mismatch}")
        contexts = settled_contexts(self.admission.contexts, self._settle)
        row = measured_row(self.plan, contexts, self._times, config, chains, drifted)
        row.phases = phase_medians(self._windows)
        return observe(row, self._sampled)
