"""One prefill point being measured inside a sweep (sweep.controller drives it): its prefixes,
its warm shot and its measured shots one step each, and its row. What a shot is, its requests
and its checks: sweep.prefill.

The runner holds the shots' state; the controller calls `next_shot` at each schedule() and
`step` after each update_from_output(), and finishes the point once `next_shot` says DONE
(every shot run, or the point failed). Whether a real prefix is still cached is asked before
the point starts, at the ranks' meeting (sweep.prefill.prefixes_missing): a restage is one
every rank takes part in. A prefix found missing later fails the point.

Under data parallel the ranks start the point's shots one engine step apart at most, and a
shot is one step: so a timed shot of one rank could run beside another rank's idle step.
`trailing` untimed shots after the timed ones (one per step of lag, as the warm shot before
them) keep every timed shot beside a shot of the same shape on every other rank.

A continuation point's shot runs a lead step first (sweep.prefill): while it is queued the
engine's prefill chunks are capped at the lead (kv.catchup.PrefillChunkCap), and the cap is
lifted before the next schedule(), so the shot's own step is the engine's as configured.

A mixed point's runner (sweep.mixed_runner) drives one of these for its prefill part, with
its decode part running beside every shot (`beside`): a shot's step is then checked to run
that part as it should, and the shot's own check leaves its requests out.
"""

from __future__ import annotations

import enum

from ..kv.catchup import PrefillChunkCap
from ..kv.layout import group_layouts
from ..kv.prefix import prefix_unit
from ..record import vocabulary as v
from ..record.artifact import PointRow
from .plan import PointPlan
from .prefill import (
    PrefillShots,
    Shot,
    TailText,
    check_shot,
    free_seeds,
    prefill_row,
    seed_fake_prefixes,
    shot_requests,
    verify_step,
)
from .rows import observe
from .timing import Window


class Next(enum.Enum):
    SHOT = "shot"  # a shot is queued or still running: carry on
    DONE = "done"  # every shot run, or the point failed: finish it


class PrefillRunner:
    def __init__(
        self,
        scheduler,
        plan: PointPlan,
        chains: list,
        tails: TailText,
        steady_steps: int,
        ids: tuple,
        trailing: int = 0,
        settle: int = 0,
        beside=None,
    ):
        """The point's requests' prefixes (chain i's first kv_i tokens, fake prefixes, or
        none); `ids`: (the point's index, the sweep's number), which its requests' ids carry;
        `trailing`: untimed shots after the timed ones; `settle`: untimed shots after the warm
        one; `beside`: what runs beside each shot (a mixed point's decode part: its `ids()`,
        and `check(scheduled)`, the reason and detail where a step did not run it right)."""
        point = plan.point
        kvm = scheduler.kv_cache_manager
        unit = prefix_unit(group_layouts(kvm), kvm.block_pool.hash_block_size)
        prefixes, hits, lead = point.prefixes(unit), point.hits(unit), point.lead(unit)
        if not point.total_kv_read_tokens:
            regime, prompts, salts = v.NOT_APPLICABLE, [[] for _ in prefixes], [None] * len(prefixes)
        elif plan.real:
            regime = v.REAL_PREFIX
            prompts = [c.prompt_token_ids[:h] for c, h in zip(chains, hits)]
            salts = [c.cache_salt for c in chains]
        else:
            vocab = max(3, scheduler.vllm_config.model_config.get_vocab_size())
            regime = v.FAKE_PREFIX
            prompts = [[(i * 7919 + 31 * t + 2) % vocab for t in range(h)] for i, h in enumerate(hits)]
            salts = [None] * len(prefixes)
        self.plan = plan
        self.shots = PrefillShots(
            point, regime, prefixes, point.new_tokens(), prompts, salts, steady_steps, trailing, settle, lead
        )
        self._tails, self._ids, self._beside = tails, ids, beside
        self._cap: PrefillChunkCap | None = None  # while a continuation's lead step is queued
        if regime == v.FAKE_PREFIX:
            seed_fake_prefixes(scheduler, self.shots, f"{ids[0]}_s{ids[1]}")

    def current_ids(self) -> set[str]:
        """The ids of the requests the step may run: the current shot's (none before the
        first, and none while a continuation's lead step is in flight)."""
        return set() if self.lead_in_flight() else self.shot_ids()

    def lead_in_flight(self) -> bool:
        """Whether a continuation's lead step is scheduled and its output not in yet."""
        shot = self.shots.current
        return bool(self.shots.lead) and shot is not None and not shot.done and not shot.led and shot.lead_scheduled()

    def shot_ids(self) -> set[str]:
        """The ids of the current shot's requests (none before the first)."""
        shot = self.shots.current
        return {r.request_id for r in shot.requests} if shot else set()

    def request_ids(self) -> list[str]:
        """The ids of every shot's requests so far."""
        return [r.request_id for s in self.shots.shots for r in s.requests]

    def next_shot(self, scheduler) -> Next:
        """Queue the next shot once the last one's requests are gone (they finish after their
        one token); the first shot warms up, untimed, and the settling and trailing ones are
        untimed too."""
        shots = self.shots
        shot = shots.current
        if self._cap is not None and shot.lead_scheduled():
            self._lift_cap()
        if shot is not None and (not shot.done or any(r.request_id in scheduler.requests for r in shot.requests)):
            return Next.SHOT
        if shots.finished:
            return Next.DONE
        timed = shots.next_is_timed()
        index, number = self._ids
        requests = shot_requests(scheduler, shots, self._tails, f"{index}_{len(shots.shots)}_s{number}")
        problem = check_shot(scheduler, shots, requests)
        if problem is not None:
            shots.failure = problem
            return Next.DONE
        shots.shots.append(Shot(requests, timed))
        if shots.lead:
            self._cap = PrefillChunkCap(scheduler, shots.lead)
            self._cap.apply()
        for request in requests:
            scheduler.add_request(request)
        return Next.SHOT

    def _lift_cap(self) -> None:
        if self._cap is not None:
            self._cap.restore()
            self._cap = None

    def step(self, output, window: Window | None) -> None:
        """After a step: the current shot's, if it ran in it, is checked and its time kept:
        the forward of the step's own span (from the end of the schedule() that scheduled
        the shot, whichever loop runs; sweep.timing)."""
        shots = self.shots
        shot = shots.current
        ids = self.shot_ids()
        if shot is None or shot.done:
            return
        new = any(r.req_id in ids for r in output.scheduled_new_reqs)
        if shots.lead and not shot.led:  # a continuation's lead step: checked, untimed
            if new:
                shot.led = True
                scheduled, new_reqs = output.num_scheduled_tokens, output.scheduled_new_reqs
                shots.failure = verify_step(shots, shot, scheduled, new_reqs, output.scheduled_cached_reqs, True)
                shot.done = shots.failure is not None
            return
        if not (any(i in ids for i in output.scheduled_cached_reqs.req_ids) if shots.lead else new):
            return
        shot.done = True
        problem = self._verify(shot, output)
        span = window.span if window is not None else None
        if problem is None and shot.timed and span is None:
            raise RuntimeError(
                "a bug: a timed prefill shot's step came without its span; the sweep must be driven through the "
                "scheduler adapter (vllm.kvwarm.scheduler), whose StepTimer times every step it scheduled"
            )
        if problem is not None:
            shots.failure = problem
        elif shot.timed:
            shots.times.append(span.phases["forward"])
            shots.windows.append(span)

    def _verify(self, shot: Shot, output) -> tuple[str, str] | None:
        """The shot's step held exactly the point's shape, and what runs beside the shot as it
        should (else the reason and detail)."""
        scheduled = output.num_scheduled_tokens
        if self._beside is not None:
            problem = self._beside.check(scheduled)
            if problem is not None:
                return problem
            beside = self._beside.ids()
            scheduled = {i: n for i, n in scheduled.items() if i not in beside}
        return verify_step(self.shots, shot, scheduled, output.scheduled_new_reqs, output.scheduled_cached_reqs)

    def release(self, scheduler) -> None:
        """Give back the point's fake prefixes and the engine's chunk size (at its end, or
        when it starts over)."""
        self._lift_cap()
        free_seeds(scheduler, self.shots)

    def finish(self, scheduler) -> PointRow:
        """End the point: its requests still there are aborted, its prefixes freed; its row."""
        from vllm.v1.request import RequestStatus

        live = [i for i in self.request_ids() if i in scheduler.requests]
        if live:
            scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        self.release(scheduler)
        return observe(prefill_row(self.shots), self.shots.windows)  # the spans: each shot's own step
