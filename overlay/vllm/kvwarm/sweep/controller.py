"""The sweep as a plain controller that the scheduler adapter drives, one phase at a time.

First, a generated grid (`lay_grid`) is laid in the ranks' smallest pool; a resumed sweep's
ranks agree on the points every one finished (sweep.resume). Then per rung (one batch size,
deepest rung first; sweep.plan; a rung with nothing left to measure is not built):
  plan    the ranks agree on the smallest usable pool, every rank trims to it, and they
          compare plan digests (a mismatch stops every rank);
  build   B chains of the rung's depth are added; vLLM prefills them; each is parked;
  points  per point (sweep.point_order) the ranks meet, then its B requests (shadows, or
          fake-KV requests) are queued one token short of each context (exact state: on
          catch-ups prefilled to their own contexts first, sweep.catchups); the admission
          step runs untimed, the steady steps are timed (sweep.decode_steps, sweep.rows);
  shed    the rung's chains are finished, then the rung's fake-KV points are measured.
At the end the prefix cache is reset (the leak check, sweep.leak_check). A sweep that is not
`real` (warm-up off, or the gate refused the model) plans no chains: every point runs on fake
KV, stamped with `fake_regime`; an A/B one measures every point both ways (sweep.ab).

Across data-parallel ranks every rank runs this same controller and they meet at its
boundaries (MEETING, sweep.meetings), so every rank enters its admission and timed steps
together and no rank's timed step overlaps another's chain prefill. B is per rank. Prefill
and mixed points are started and driven by a collaborator (sweep.prefill_points), through the
calls of its interface alone; whether a point's chains must be built again is settled at its
meeting, so a restage is one every rank takes part in.

The adapter calls `before_schedule` in each schedule() and `after_update` after each
update_from_output(); `has_work()` keeps the engine stepping; `measuring()` names the only
requests a step may run while a point is measured. Nothing here imports the engine: tests step
it against a real Scheduler, the model runner's part played by the test.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from ..kv.catchup import PrefillChunkCap
from ..kv.injector import Admission
from ..kv.layout import group_layouts
from ..kv.prefix import prefix_unit
from ..record import vocabulary as v
from ..record.artifact import PointRow
from ..record.shape import GraphConfig, expected_graph, step_tokens
from .catchups import CatchUps, catchup_admission, end_catchups, park_caught_up, start_catchups
from .decode_steps import DecodeSteps, shadow_admission
from .exchange.solo import SoloExchange
from .gc_hold import GcHold
from .gc_workers import worker_hold
from .leak_check import LeakCheck
from .limits import trim_mixed_rung
from .meetings import BODIES, Meetings, check_same_point, has_others, pool_record, usable_blocks
from .phase import Phase
from .plan import (
    PointPlan,
    Rung,
    SweepConfig,
    SweepSetup,
    injected_contexts,
    plan_digest,
    plan_mixed_rung,
    plan_prefill_rung,
    plan_rungs,
    points_digest,
    trim_rung,
)
from .point_order import PointOrder
from .points import DecodePoint, MixedPoint, PrefillPoint
from .prefill import TailText
from .prefill_points import PointInputs, PrefillPoints
from .ranks import RankFailed
from .resume import Resumed, agree, ranges
from .rows import skipped_row
from .rung_chains import add_chains, end_chains, park_built
from .timing import StepTimer, Window

# Each sweep in a process names its requests apart: vLLM's runner forgets a finished request's
# align-mode state slot only in a step with a forward; a later chain of the same id would reuse it.
_SWEEP_NUMBERS = itertools.count()


class Sweep:
    def __init__(
        self,
        points: list[DecodePoint | PrefillPoint | MixedPoint],
        chain_tokens: Callable[[int, int], list[int]] | None,
        config: SweepConfig,
        *,
        clock: Callable[[], float] = time.perf_counter,
        progress: Callable[[str], None] = print,
        on_row: Callable[[PointRow], None] | None = None,
        exchange=None,
        tail_tokens: list[int] | None = None,
        vocab_size: int = 0,
        graphs: GraphConfig | None = None,
        lay_grid: Callable[[dict], SweepSetup] | None = None,
        resumed: Resumed | None = None,
        on_resume: Callable[[list, list], None] | None = None,
    ):
        """`tail_tokens`: text the chains never use, for the new tokens of prefill points
        (the held-out half of the dataset; synthetic tokens where None); `vocab_size` bounds
        the synthetic tokens (the model's vocabulary); `graphs`: the engine's CUDA graphs, whose
        expected one each measured row records. `lay_grid`: the sweep's points are a grid,
        laid once the ranks agree on the pool (given the smallest of each BODIES["grid"]
        value), which gives what the first arguments give otherwise. `resumed`: an earlier boot's
        rows; `on_resume` gets those the ranks keep, and those measured again (sweep.resume)."""
        self.rows: list[PointRow] = []
        self.stages: list[dict] = []  # one per rung built: batch, depth, build_seconds
        self.phase = Phase.NEXT_RUNG
        self.reset_prefix_cache_ok: bool | None = None
        self._number = next(_SWEEP_NUMBERS)  # in its requests' ids
        self._vocab_size, self._lay_grid, self._graphs = vocab_size, lay_grid, graphs
        self._adopt(SweepSetup(points, chain_tokens, config, tail_tokens))
        self.clock = clock
        self.timer = StepTimer(clock)  # the adapter reports its clock readings to it
        self._gc = GcHold(config.gc_hold)
        self._progress, self._on_row = progress, on_row or (lambda row: None)
        self._meetings = Meetings(exchange or SoloExchange())
        self._rung: Rung | None = None
        self._queue: list[PointPlan] = []
        self._point: DecodeSteps | None = None  # the decode point being measured
        self._catchups: CatchUps | None = None
        self._prefills = PrefillPoints(self._meetings.exchange.size)  # prefill and mixed points
        self._restaging: PointPlan | None = None  # a prefill point waiting for its chains again
        self._chunk_cap: PrefillChunkCap | None = None  # exact: while a rung's chains are built
        self._drifted: set[str] = set()  # chains an in-place shadow has advanced
        self._leak_check = LeakCheck(self.clock, self._progress)
        self._resumed, self._on_resume = resumed, on_resume or (lambda kept, replaced: None)
        # the point plan being measured, and the point list's index of the last row handed on
        self._plan, self.point_index = None, None

    def _adopt(self, setup: SweepSetup) -> None:
        self.config = setup.config
        self.rungs = plan_rungs(setup.points, setup.config.decode_steps, setup.config.max_model_len, setup.config.real)
        self._points, self._chain_tokens = setup.points, setup.chain_tokens
        self._order = PointOrder(setup.points, setup.config.ab)
        self._points_digest = points_digest(setup.points)  # once: plan_digest takes it at every rung
        self._tails = TailText(setup.tail_tokens or [], self._vocab_size)

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    def has_work(self) -> bool:
        return not self.done

    def measuring(self) -> set[str] | None:
        """While a point is admitted and measured: the ids of its requests, the only ones
        its steps may schedule (empty until they are admitted). None between points."""
        if self._prefills.running:
            return self._prefills.current_ids()
        return None if self._point is None else self._point.ids()

    def may_run_own_requests(self) -> bool:
        """Whether the next step may run the sweep's own requests (chains, catch-ups, a
        point's): such a step is the sweep's, not a served one (served.recorder)."""
        return self.phase in (Phase.BUILDING, Phase.CATCHING_UP, Phase.MEASURING)

    def gc_record(self) -> dict:
        """The collector's policy over the sweep, for the artifact."""
        return self._gc.record()

    def plan_digest(self, rung: Rung) -> str:
        return plan_digest(self._points_digest, self.config, rung)

    # --- driven by the adapter -------------------------------------------------------------

    def before_schedule(self, scheduler) -> None:
        if self._gc.enabled and self._gc.workers is None:  # the engine's executor is known once it steps
            self._gc.workers = worker_hold(scheduler)
        phase = self.phase
        if phase is Phase.MEETING:
            self._meetings.poll(busy=has_others(scheduler))
        elif phase is Phase.NEXT_RUNG:
            self._start_next_rung(scheduler)
        elif phase is Phase.BUILDING:
            self._build_step(scheduler)
        elif phase is Phase.NEXT_POINT:
            self._next_point(scheduler)
        elif phase is Phase.CATCHING_UP:
            self._catch_up_step(scheduler)
        elif phase is Phase.ENDING:
            self._end(scheduler)
        elif phase is Phase.MEASURING and self._prefills.running:
            self._next_shot(scheduler)

    def after_update(self, scheduler, output, window: Window | None = None) -> None:
        """`window`: the step that just ended, as the adapter's StepTimer closed it."""
        if self.phase is not Phase.MEASURING:
            return
        if self._prefills.running:
            self._prefills.step(output, window)
            return
        point = self._point
        if point.admission.failure is not None:
            self._finish_point(skipped_row(point.plan.point, v.POINT_SKIP_REASON, point.admission.failure), scheduler)
        elif point.step(output, window):
            chains = self._rung.chains[: point.plan.point.batch_size]
            self._finish_point(point.row(self.config, chains, self._drifted), scheduler)

    def abandon(self, scheduler, error: str) -> None:
        """This rank's sweep stopped on `error`: give back what it holds (chains, the point's
        requests) so the engine serves on, and tell the other ranks at their next boundary
        instead of leaving them waiting."""
        from vllm.v1.request import RequestStatus

        self.phase = Phase.DONE
        self._gc.end()
        self._meetings.fail(error)
        scheduler.kvwarm_injector.drop_pending()
        ids = [r.request_id for r in self._point.admission.shadows] if self._point else []
        ids += [c.request_id for c in self._rung.chains] if self._rung else []
        ids += [c.request_id for c in self._catchups.requests] if self._catchups else []
        ids += self._prefills.abandon(scheduler)
        self._point, self._catchups = None, None
        self._restore_chunks()
        live = [i for i in ids if i in scheduler.requests]
        if live:
            scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)

    # --- meetings ----------------------------------------------------------------------------

    def _meet(self, kind: str, record: dict, then: Callable[[list[dict]], None]) -> None:
        """Post this rank's record for a boundary; `then` runs once every rank has posted."""
        self._meetings.post(kind, record, then)
        self.phase = Phase.MEETING

    # --- rungs -------------------------------------------------------------------------------

    def _start_next_rung(self, scheduler) -> None:
        if self._lay_grid is not None:
            self._meet("grid", pool_record(scheduler), self._grid_laid)
            return
        if self._resumed is not None:
            self._meet("resume", {"done": ranges(self._resumed.done())}, self._resume_agreed)
            return
        while self.rungs and self._order.finished(self.rungs[0]):
            self.rungs.pop(0)  # measured in an earlier boot
        if not self.rungs:
            self.phase = Phase.ENDING
            self._end(scheduler)
            return
        rung = self._rung = self.rungs.pop(0)
        usable = usable_blocks(scheduler.kv_cache_manager)
        self._meet("pool", {"usable_blocks": usable}, lambda records: self._plan_rung(scheduler, rung, records))

    def _grid_laid(self, records: list[dict]) -> None:
        """Every rank lays the grid in the smallest pool; the first rung starts next."""
        pool = {field: min(r[field] for r in records) for field in BODIES["grid"]}
        lay, self._lay_grid = self._lay_grid, None
        self._adopt(lay(pool))
        self.phase = Phase.NEXT_RUNG

    def _resume_agreed(self, records: list[dict]) -> None:
        """The ranks agree on the points every one finished; this rank keeps its rows of those."""
        (self._order.done, kept, replaced), self._resumed = agree(self._resumed, records), None
        self.rows = [row for *_, row in kept]
        self._on_resume(kept, replaced)
        self.phase = Phase.NEXT_RUNG

    def _plan_rung(self, scheduler, rung: Rung, records: list[dict]) -> None:
        """Every rank trims to the smallest usable pool, then the ranks compare plans."""
        kvm = scheduler.kv_cache_manager
        if rung.prefill:
            plan_prefill_rung(rung, prefix_unit(group_layouts(kvm), kvm.block_pool.hash_block_size))
        elif rung.mixed:
            unit = prefix_unit(group_layouts(kvm), kvm.block_pool.hash_block_size)
            usable = min(r["usable_blocks"] for r in records)
            trim_mixed_rung(rung, group_layouts(kvm), self.config, usable, unit)  # never waits on blocks
            plan_mixed_rung(rung, unit, self.config)
        elif rung.depth:
            trim_rung(rung, group_layouts(kvm), self.config, min(r["usable_blocks"] for r in records))
        digest = self.plan_digest(rung)
        self._meet("plan", {"digest": digest}, lambda records: self._build_rung(scheduler, rung, records))

    def _build_rung(self, scheduler, rung: Rung, records: list[dict]) -> None:
        digests = {r["rank"]: r["digest"] for r in records}
        if len(set(digests.values())) > 1:
            raise RankFailed(
                f"plan mismatch before rung batch={rung.batch_size}: "
                + ", ".join(f"rank {r} {d}" for r, d in sorted(digests.items()))
            )
        rung.started = self.clock()
        self._queue = self._order.plans(rung)
        if not rung.depth:
            self.phase = Phase.NEXT_POINT
            return
        self._add_chains(scheduler, rung)

    def _add_chains(self, scheduler, rung: Rung) -> None:
        self._progress(
            f"rung batch={rung.batch_size}: building {rung.batch_size} chain(s) of {rung.depth} tokens"
            + (f" ({len(rung.fake_points)} point(s) beyond them on fake KV)" if rung.fake_points else "")
        )
        self._chunk_cap = add_chains(scheduler, rung, self._chain_tokens, self.config, self._number)
        self.phase = Phase.BUILDING

    def _build_step(self, scheduler) -> None:
        """Park the chains as they are prefilled; once all are, the rung is built and its
        first point starts in this same call."""
        rung = self._rung
        if not park_built(scheduler, rung.chains):
            return
        self._restore_chunks()
        seconds = self.clock() - rung.started
        self.stages.append({"batch": rung.batch_size, "depth": rung.depth, "build_seconds": round(seconds, 3)})
        self._gc.freeze()  # the chains and everything before: never collected while they serve
        self._progress(f"rung batch={rung.batch_size}: {rung.batch_size} chain(s) built in {seconds:.1f} s")
        if self._restaging is not None:  # the point whose prefix was lost meets again, first
            self._queue.insert(0, self._restaging)
            self._restaging = None
        self.phase = Phase.NEXT_POINT
        self._next_point(scheduler)

    def _restore_chunks(self) -> None:
        if self._chunk_cap is not None:
            self._chunk_cap.restore()
            self._chunk_cap = None

    # --- points ------------------------------------------------------------------------------

    def _next_point(self, scheduler) -> None:
        if self._queue and self._queue[0].beyond:
            end_chains(scheduler, self._rung)  # fake points need no chains, and their blocks may not fit beside them
        if not self._queue:
            end_chains(scheduler, self._rung)  # the rung is shed
            self._rung = None
            self.phase = Phase.NEXT_RUNG
            return
        plan = self._plan = self._queue.pop(0)
        restage = self._prefills.must_restage(scheduler, plan, self._rung.chains)
        record = {"index": len(self.rows), "restage": restage}
        self._meet("point", record, lambda records: self._start_point(scheduler, plan, records))

    def _start_point(self, scheduler, plan: PointPlan, records: list[dict]) -> None:
        check_same_point(records)
        if any(r["restage"] for r in records):
            self._restage(scheduler, plan, [r["rank"] for r in records if r["restage"]])
            return
        if plan.prefill or plan.mixed:
            self._start_prefill(scheduler, plan)
            return
        point, config = plan.point, self.config
        contexts = injected_contexts(point, config.settle_steps)
        # Fake points below the giant-KV threshold keep the single step of the legacy path
        # (an A/B sweep's time as many steps on both sides).
        many = plan.real or plan.ab is not None or point.total_kv_read_tokens >= config.giant_kv_threshold
        timed = config.steady_steps if many else 1
        steps = config.settle_steps + timed + config.trailing_steps  # what they run after their admission
        chains = self._rung.chains[: point.batch_size]
        if plan.real and config.state_mode == v.EXACT:
            self._catchups = start_catchups(
                scheduler, plan, chains, contexts, steps, config, f"catchup{len(self.rows)}_s{self._number}"
            )
            self.phase = Phase.CATCHING_UP
            return
        self._measure(scheduler, plan, shadow_admission(scheduler, plan.real, chains, contexts, steps, config))

    def _catch_up_step(self, scheduler) -> None:
        """Once every catch-up stands at its context, the ranks meet and the point's shadows
        are queued on them (or the point is skipped where its catch-ups did not fit)."""
        if park_caught_up(scheduler, self._catchups):
            self._meet("caught_up", {"index": len(self.rows)}, lambda records: self._after_catch_up(scheduler, records))

    def _after_catch_up(self, scheduler, records: list[dict]) -> None:
        check_same_point(records)
        catchups = self._catchups
        if catchups.plan.mixed:
            row = self._prefills.caught_up(scheduler, catchups, self._point_inputs())
            if row is not None:
                self._finish_point(row, scheduler)
            else:
                self._measure_shots(scheduler)
            return
        if catchups.short:
            self._finish_point(skipped_row(catchups.plan.point, v.POINT_SKIP_REASON, catchups.short), scheduler)
            return
        chains = self._rung.chains[: catchups.plan.point.batch_size]
        self._measure(scheduler, catchups.plan, catchup_admission(catchups, chains, self.config))

    def _measure(self, scheduler, plan: PointPlan, admission: Admission) -> None:
        """Queue the point's requests; its admission and timed steps follow (after_update)."""
        settle = self.config.settle_steps
        timed = admission.steady_steps - self.config.trailing_steps - settle
        self._point = DecodeSteps(plan, scheduler.kvwarm_injector.queue(admission), self.clock, timed, settle)
        self._gc.hold()
        self.phase = Phase.MEASURING

    # --- prefill and mixed points (sweep.prefill_points) -------------------------------------

    def _point_inputs(self) -> PointInputs:
        return PointInputs(self._rung.chains, len(self.rows), self._number, self.config, self._tails, self._drifted)

    def _start_prefill(self, scheduler, plan: PointPlan) -> None:
        """The point's runner starts and its warm shot is queued, or its catch-ups first."""
        self._catchups = self._prefills.start(scheduler, plan, self._point_inputs())
        if self._catchups is not None:
            self.phase = Phase.CATCHING_UP
            return
        self._measure_shots(scheduler)

    def _measure_shots(self, scheduler) -> None:
        self._gc.hold()
        self.phase = Phase.MEASURING
        self._next_shot(scheduler)

    def _next_shot(self, scheduler) -> None:
        row = self._prefills.next_shot(scheduler)
        if row is not None:
            self._finish_point(row, scheduler)

    def _restage(self, scheduler, plan: PointPlan, asked: list[int]) -> None:
        """A rank (`asked`) found a prefix of the point no longer cached: every rank builds its
        rung's chains again, once, and the point meets again (its prefixes are not asked
        again: a prefix still missing then fails the point)."""
        plan.retried = True
        self._progress(
            f"prefill point N={plan.point.total_prefill_tokens} P={plan.point.total_kv_read_tokens}: "
            f"a chain's prefix was not cached on rank(s) {asked}; building the chains again"
        )
        self._restaging = plan
        end_chains(scheduler, self._rung)
        self._rung.started = self.clock()
        self._add_chains(scheduler, self._rung)

    def _finish_point(self, row: PointRow, scheduler) -> None:
        if self._graphs is not None and not row.skipped:
            row.graph = expected_graph(self._graphs, *step_tokens(row.point))
        row.ab, row.ab_first = self._plan.ab, self._plan.ab_first
        self.point_index = self._order.index_of(self._plan)
        self.rows.append(row)
        self._point = None
        if self._catchups is not None:
            end_catchups(scheduler, self._catchups)
            self._catchups = None
        self.phase = Phase.NEXT_POINT
        self._gc.release()  # a collection now, between points
        self._on_row(row)  # the run logs a point's line at its own pace (sweep.progress)

    # --- the end -----------------------------------------------------------------------------

    def _end(self, scheduler) -> None:
        """The leak check (sweep.leak_check), once requests from outside are done."""
        ended, self.reset_prefix_cache_ok = self._leak_check.run(scheduler)
        if not ended:
            return
        self._gc.end()
        self.phase = Phase.DONE
        self._progress(f"sweep done: {len(self.rows)}/{self._order.rows} row(s)")
