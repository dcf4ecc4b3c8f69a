"""One mixed point being measured inside a sweep (sweep.controller drives it): one step that
holds exactly the decode part's requests (shadows one token each at their contexts, on real
KV as decode points' are, or fake KV) and the prefill part's new requests (their new tokens on
a real prefix, as prefill points' shots are; sweep.prefill). In exact state the decode part's
shadows borrow from catch-ups, as a decode point's do (sweep.catchups): the controller
prefills and parks them first and hands the runner their admission.

The decode part's shadows are queued first and admitted alone (their admission step is
scaffolding, untimed). From the next step on they decode one token a step, and shots of the
prefill part join them: the first shot warms up, untimed, then the settle shots (untimed;
the shadows are admitted short by the tokens they compute before the first timed shot:
points.mixed_advance), then the measured shots, each with fresh tails. A shot joins once the
last one's requests are gone and, for new requests, after a gap: one step of the shadows
alone (points.mixed_gap_steps), as a served prompt's first chunk joins decodes that ran
alone (on one rank only: ranks may start a point a step apart, and there a trailing untimed
shot follows the measured ones, as a prefill point's does, so that every timed shot runs
beside a shot of the same shape on every other rank: sweep.prefill_runner). Under vLLM's batch queue,
where a step is scheduled before the last one's output is in, the step scheduled while a
shot's or a gap's is in flight runs nothing (current_ids), so each shot's span holds its
own step's forward. The shadows run enough steps (points.mixed_decode_steps) and are
aborted when the point ends.

A shot's step is checked to hold exactly the shadows, one token each, and the shot's B_p
requests, N new tokens and a hit of P (else the point is skipped with the measured_*
reason); its time is its span's forward, as a prefill shot's (sweep.timing), every sample
kept, the upper median the row's. The shadows advance a token a step, as a decode point's
do: the decode part's K is the one of the step before the first timed shot (its gap step,
the warm shot's or the last settle shot's); on real KV the row carries the state stamps a
decode row of the same shadows would (sweep.rows.state_reasons).

The runner is a decode part (`DecodePart`: the shadows' admission, their ids, the check of a
shot's step) and a prefill point's runner for the shots (sweep.prefill_runner), which it
drives, with the decode part beside every shot, between the gap steps.
"""

from __future__ import annotations

import enum

from ..kv.injector import Admission
from ..record import vocabulary as v
from ..record.artifact import PointRow
from .decode_steps import shadow_admission
from .plan import PointPlan, SweepConfig, injected_contexts, settled_contexts
from .points import MixedPoint, mixed_advance, mixed_decode_steps, mixed_gap_steps
from .prefill import TailText, skipped_row
from .prefill_runner import Next, PrefillRunner
from .rows import fake_regime, state_reasons


class Gap(enum.Enum):
    """A gap step (the decode part alone, before a shot) on its way."""

    SCHEDULING = "scheduling"  # this schedule() schedules it
    IN_FLIGHT = "in flight"  # scheduled, its output not in yet


class DecodePart:
    def __init__(
        self, scheduler, plan: PointPlan, chains: list, config: SweepConfig, advance: int, admission: Admission | None
    ):
        """Queue the decode part's shadows at its contexts less `advance` (the tokens they
        compute before the first timed shot): on chain i (`chains`: the rung's; none on fake
        KV), or as `admission` says where the controller made it (exact state: on the point's
        catch-ups)."""
        decode = plan.point.decode
        self.chains = chains[: decode.batch_size]
        contexts = injected_contexts(decode, advance)
        if admission is None:
            steps = mixed_decode_steps(config.decode_steps)
            admission = shadow_admission(scheduler, plan.real, self.chains, contexts, steps, config)
        self.admission = scheduler.kvwarm_injector.queue(admission)

    def admitted(self) -> bool:
        return bool(self.admission.shadows)

    def ids(self) -> set[str]:
        return {r.request_id for r in self.admission.shadows}

    def check(self, scheduled: dict[str, int]) -> tuple[str, str] | None:
        """A shot's step ran every shadow at one token (else the reason and detail)."""
        shadows = self.ids()
        ran = [i for i in shadows if scheduled.get(i) == 1]
        if len(ran) == len(shadows):
            return None
        return v.BATCH_SIZE_MISMATCH, (
            f"{v.BATCH_SIZE_MISMATCH}: the step ran {len(ran)} of the decode part's {len(shadows)} request(s) "
            "at one token each"
        )


class MixedRunner:
    def __init__(
        self,
        scheduler,
        plan: PointPlan,
        chains: list,
        tails: TailText,
        config: SweepConfig,
        ids: tuple,
        drifted: set[str],
        admission: Admission | None = None,
        ranks: int = 1,
    ):
        """`chains`: the rung's (chain i lends to decode request i and to prefix i; none on
        fake KV); `ids`: (the point's index, the sweep's number); `drifted`: the chains an
        in-place shadow has advanced (sweep.rows.state_reasons); `admission`: the decode
        part's, where the controller made it (exact state: on the point's catch-ups); `ranks`:
        the data-parallel ranks measuring it (points.mixed_gap_steps)."""
        point = plan.point
        self.plan, self._config, self._drifted = plan, config, drifted
        self._gaps = mixed_gap_steps(point, ranks)
        self._advance = mixed_advance(point, config.settle_steps, ranks)
        self._gap_due = 0  # gap steps still to run before the next shot
        self._gap: Gap | None = None
        self.decode = DecodePart(scheduler, plan, chains, config, self._advance, admission)
        prefill_plan = PointPlan(point.prefill, plan.real)
        steps, settle = config.steady_steps, config.settle_steps
        trailing = 1 if ranks > 1 else 0  # ranks a step apart (sweep.prefill_runner)
        self.prefill = PrefillRunner(
            scheduler, prefill_plan, chains, tails, steps, ids, trailing, settle, beside=self.decode
        )

    def current_ids(self) -> set[str]:
        """The shadows and the current shot's requests: all the step may run. Under vLLM's
        batch queue the step after a shot's is scheduled before the shot's output is in: it
        runs nothing (the shadows are held a step), so the loop waits for the shot's output
        alone and the shot's forward is its own step's. A continuation's lead step runs the
        shot alone (the shadows advance a token a shot, as for new requests)."""
        prefill = self.prefill
        shot = prefill.shots.current
        if prefill.lead_in_flight() or self._gap is Gap.IN_FLIGHT:
            return set()
        if self._gap is Gap.SCHEDULING:
            return self.decode.ids()
        if shot is not None and not shot.done:
            if prefill.shots.lead and not shot.led:
                return prefill.shot_ids()  # the lead step, not scheduled yet
            if all(r.num_computed_tokens >= r.num_prompt_tokens for r in shot.requests):
                return prefill.shot_ids()  # scheduled (its prompt counted computed), not yet taken in
        return self.decode.ids() | prefill.shot_ids()

    def request_ids(self) -> list[str]:
        """The ids of the shadows and of every shot's requests so far."""
        return [*self.decode.ids(), *self.prefill.request_ids()]

    def next_shot(self, scheduler) -> Next:
        """No shot before the shadows are admitted (their admission step runs alone), and the
        gap steps due before the next one."""
        shots = self.prefill.shots
        if self.decode.admission.failure is not None and shots.failure is None:
            shots.failure = (v.POINT_SKIP_REASON, self.decode.admission.failure)
        if shots.failure is not None:
            return Next.DONE
        if not self.decode.admitted():
            return Next.SHOT
        if self._gap is not None:  # scheduled, its output not in yet
            self._gap = Gap.IN_FLIGHT
            return Next.SHOT
        if self._gap_due and not shots.finished:
            self._gap_due -= 1
            self._gap = Gap.SCHEDULING
            return Next.SHOT
        return self.prefill.next_shot(scheduler)

    def step(self, output, window) -> None:
        """After a step: a shot's is checked and timed (PrefillRunner.step, the decode part
        beside it), and the gap steps are due after it; a gap's output is in once a step ran
        the shadows alone."""
        shots = self.prefill.shots
        shot = shots.current
        running = shot is not None and not shot.done
        self.prefill.step(output, window)
        if running and shot.done and shots.failure is None:
            self._gap_due = self._gaps
        scheduled = output.num_scheduled_tokens
        if self._gap is not None and scheduled and set(scheduled) <= self.decode.ids():
            self._gap = None

    def release(self, scheduler) -> None:
        self.prefill.release(scheduler)

    def finish(self, scheduler) -> PointRow:
        """End the point: the shadows and a shot still there are aborted; its mixed row."""
        from vllm.v1.request import RequestStatus

        if not self.decode.admitted():
            scheduler.kvwarm_injector.drop_pending()  # never admitted: nothing of it is registered
        live = [i for i in self.request_ids() if i in scheduler.requests]
        if live:
            scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        return self._mixed_row(self.prefill.finish(scheduler))

    def _mixed_row(self, row: PointRow) -> PointRow:
        """The prefill part's row as the step's: its totals, its parts and its regime."""
        point, config = self.plan.point, self._config
        contexts = settled_contexts(self.decode.admission.contexts, self._advance)
        decode_k = mixed_parts(row, point, contexts)
        if row.skipped:
            return row
        if decode_k != point.decode.total_kv_read_tokens:
            row.sample_reasons.append(v.CONTEXT_CLAMPED)
        if self.plan.real:
            row.kv_seed_regime = v.REAL_KV
            row.sample_reasons.append(v.STAMP_REAL_KV)
            row.sample_reasons += state_reasons(config, contexts, self.decode.chains, self._drifted)
        else:
            row.kv_seed_regime = fake_regime(self.plan, config)
            row.sample_reasons += [v.STAMP_FAKE_FALLBACK] if row.kv_seed_regime == v.FAKE_FALLBACK else []
        return row


def mixed_parts(row: PointRow, point: MixedPoint, contexts: list[int]) -> int:
    """Make the prefill part's row (measured or skipped) the mixed step's: its type, its
    parts and its totals; the decode part's K (at `contexts`: as admitted, plus what they
    computed up to the step before the first timed shot: points.mixed_advance)."""
    decode_b = point.decode.batch_size
    decode_k = sum(contexts) + decode_b
    row.point_type = v.MIXED
    row.parts = {
        "decode": {"batch_size": decode_b, "total_kv_read_tokens": decode_k},
        "prefill": {
            "batch_size": point.prefill.batch_size,
            "total_prefill_tokens": point.prefill.total_prefill_tokens,
            "total_kv_read_tokens": point.prefill.total_kv_read_tokens,
            **({"continuation": True} if point.prefill.continuation else {}),
        },
    }
    row.continuation = False  # said in its prefill part
    row.total_kv_read_tokens += decode_k
    row.batch_size += decode_b
    return decode_k


def skipped_mixed_row(point: MixedPoint, reason: str, detail: str) -> PointRow:
    """The row of a mixed point skipped before its runner started (exact state: its
    catch-ups did not fit), shaped as the runner's skipped rows are."""
    row = skipped_row(point.prefill, reason, detail)
    mixed_parts(row, point, injected_contexts(point.decode))
    return row
