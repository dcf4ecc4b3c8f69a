"""The decode sweep as a plain controller that the scheduler adapter drives.

Phases, per rung (one batch size, deepest rung first):
  plan    the rung's chain depth covers its deepest point plus the admission token and
          the steady steps, trimmed until B chains and their shadows' tails fit the free
          pool; points the trimmed chains cannot cover fall back to fake KV (measured last);
  build   add B chains of that depth, let vLLM prefill them, park them;
  points  per point: queue its B requests (shadows, or fake-KV requests), one token short
          of each context (in exact state mode the shadows borrow from catch-up chains
          prefilled to their own contexts first: exact_state); let the admission step run
          untimed; time the steady steps (the gap between consecutive update_from_output
          calls), keep every time and the upper median (upstream's sorted[n // 2]);
          the requests then finish by length;
  shed    finish the rung's chains, then measure the rung's fake-KV points.
At the end the prefix cache is reset (the leak check: it only succeeds when nothing but
the null block is in use).

A sweep that is not `real` (warm-up off, or the gate refused the model) plans no chains:
every point runs on fake KV, stamped with `fake_regime`.

Across data-parallel ranks (ranks.py) every rank runs this same controller and they meet
at its boundaries: before a rung, they agree on the smallest free pool (so every rank
trims to the same depth) and then compare plan digests (a mismatch stops every rank);
before each point, they check they are at the same point, so every rank enters its
admission and timed steps together and no rank's timed step overlaps another's chain
prefill. B is per rank: each rank admits B requests.

While a point is admitted and measured, `measuring()` names the only requests the step may
run; the adapter keeps every other request (a server's own) queued until the point ends.

The adapter calls `before_schedule(scheduler)` at the start of each schedule() and
`after_update(scheduler, output)` after each update_from_output(); `has_work()` keeps
the engine stepping. Nothing here imports the engine; tests step it against a real
Scheduler with the model runner's part played by the test.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .arithmetic import pool_shortfall, shadow_private_blocks, trim_depth
from .borrowing import POINT_SKIP_REASON, POOL_EXHAUSTED
from .chains import all_parked, chain_request, is_prefilled, park
from .exact_state import (
    PrefillChunkCap, cached_tokens, catchup_blocks, catchup_request, is_caught_up, planned_catchup_blocks,
    state_block_size,
)
from .injection import PendingPoint
from .layout import group_layouts
from .points import DecodePoint
from .ranks import RankFailed, SoloExchange
from .state_mode import COPY, EXACT, INPLACE, state_stamps

BATCH_SIZE_MISMATCH = "measured_batch_size_mismatch"
# A row whose timed steps spread more than this fraction of their median is stamped
# NOISY: its median may be polluted (e.g. by the first steps after a rung build).
NOISY = "kvwarm_noisy"
NOISY_SPREAD = 0.5
REAL_KV, FAKE_FALLBACK, LEGACY = "real_kv", "fake_fallback", "legacy"
CONTEXT_CLAMPED = "context_clamped"
# An in-place shadow advanced its chain's recurrent state: later points of the rung read
# the state of more tokens than the chain holds (see docs/state-handoff.md).
STATE_DRIFTED = "kvwarm_state_drifted"


@dataclass
class PointRow:
    total_kv_read_tokens: int  # what the steps measured (a clamped point's differs from the file's)
    batch_size: int
    kv_seed_regime: str  # real_kv | fake_fallback | legacy | skip:<reason>
    sample_reasons: list[str] = field(default_factory=list)
    steady_seconds: list[float] = field(default_factory=list)
    median_seconds: float | None = None
    detail: str | None = None  # why a point was skipped, in words

    @property
    def spread(self) -> float | None:
        """(max - min) / median of the timed steps."""
        if not self.steady_seconds or not self.median_seconds:
            return None
        return (max(self.steady_seconds) - min(self.steady_seconds)) / self.median_seconds


@dataclass(frozen=True)
class SweepConfig:
    repeats: int  # timed steady steps per point
    max_model_len: int
    state_mode: str | None = None  # the state hand-off mode on hybrid layouts: copy | inplace | exact
    state_lending: str | None = None  # exact: how a catch-up's state is handed over (inplace | copy)
    fork: bool | None = None  # attention tails: fork (CoW) or fresh; None: fork where the build can
    real: bool = True  # False: no chains, every point on fake KV
    fake_regime: str = FAKE_FALLBACK  # the regime of fake-KV rows: fake_fallback | legacy
    giant_kv_threshold: int = 1_000_000  # fake points below it keep the single legacy step

    @property
    def hand_off(self) -> str | None:
        """How shadows take state over (exact: from their catch-ups)."""
        return self.state_lending if self.state_mode == EXACT else self.state_mode


@dataclass
class QueuedPoint:
    point: DecodePoint
    real: bool  # on borrowed (real) KV; False: on fake KV


@dataclass
class CatchUps:
    """Exact mode: a point's catch-up chains, prefilling before its shadows are queued."""

    queued: QueuedPoint
    contexts: list[int]
    headroom: int
    requests: list
    short: str | None = None  # why none were added (the pool); the point is then skipped


@dataclass
class Rung:
    batch_size: int
    depth: int  # 0: no chains (every point on fake KV)
    points: list[DecodePoint]
    fake_points: list[DecodePoint] = field(default_factory=list)
    chains: list = field(default_factory=list)
    started: float = 0.0
    built: bool = False


def injected_contexts(point: DecodePoint) -> list[int]:
    """One token short of each context (the admission step computes the last one); a
    1-token context cannot be, so it is admitted at 1 and the point is clamped."""
    return [max(1, c - 1) for c in point.contexts()]


# Each sweep in a process names its requests apart: vLLM's runner forgets a finished
# request's align-mode state slot only in a step that runs a forward, so a later sweep's
# chain with an earlier one's id would start from that stale slot.
_SWEEP_NUMBERS = itertools.count()

# How long the end of a sweep waits for requests from outside before its leak check.
END_WAIT_SECONDS = 60.0

# A parked chain has sampled a token or two (async scheduling) after its prompt; at
# max_model_len vLLM would finish it, freeing the blocks its shadows borrow.
CHAIN_DEPTH_MARGIN = 4


def plan_rungs(points: list[DecodePoint], repeats: int, max_model_len: int, real: bool = True) -> list[Rung]:
    """One rung per batch size, deepest first; a rung's chains cover its deepest point
    plus the admission token and the steady steps, within max_model_len less a margin."""
    by_batch: dict[int, list[DecodePoint]] = {}
    for point in points:
        by_batch.setdefault(point.batch_size, []).append(point)
    rungs = []
    for batch, rung_points in sorted(by_batch.items(), reverse=True):
        rung_points.sort(key=lambda p: p.total_kv_read_tokens, reverse=True)
        if not real:
            rungs.append(Rung(batch, 0, [], fake_points=rung_points))
            continue
        # admitted one token short: the chain holds that much, the admission token and the steps
        depth = max(max(injected_contexts(p)) for p in rung_points) + 1 + repeats
        rungs.append(Rung(batch, min(depth, max_model_len - CHAIN_DEPTH_MARGIN), rung_points))
    return rungs


class DecodeSweep:
    def __init__(self, points: list[DecodePoint], chain_tokens: Callable[[int, int], list[int]] | None,
                 config: SweepConfig, *, clock: Callable[[], float] = time.perf_counter,
                 progress: Callable[[str], None] = print, on_row: Callable[[PointRow], None] | None = None,
                 exchange=None):
        self.config = config
        self.rungs = plan_rungs(points, config.repeats, config.max_model_len, config.real)
        self.rows: list[PointRow] = []
        self.stages: list[dict] = []  # one per rung built: batch, depth, build_seconds
        self._points = points
        self._number = next(_SWEEP_NUMBERS)  # in its requests' ids
        self._chain_tokens = chain_tokens
        self._clock, self._progress, self._on_row = clock, progress, on_row or (lambda row: None)
        self._exchange = exchange or SoloExchange()
        self._waiting: Callable[[list[dict]], None] | None = None  # what to do once the ranks meet
        self._rung: Rung | None = None
        self._queue: list[QueuedPoint] = []
        self._point: tuple[QueuedPoint, PendingPoint] | None = None
        self._catchups: CatchUps | None = None
        self._chunk_cap: PrefillChunkCap | None = None  # exact: while a rung's chains are built
        self._times: list[float] = []
        self._last_update: float | None = None
        self._mismatch: str | None = None  # why the point's steps were not B alone
        self._drifted: set[str] = set()  # chains an in-place shadow has advanced
        self._ending: float | None = None  # when the sweep began waiting for outside requests to end
        self.done = False
        self.reset_prefix_cache_ok: bool | None = None

    def has_work(self) -> bool:
        return not self.done

    def measuring(self) -> set[str] | None:
        """While a point is admitted and measured: the ids of its requests, the only ones
        its steps may schedule (empty until they are admitted). None between points."""
        if self._point is None:
            return None
        return {r.request_id for r in self._point[1].shadows}

    def plan_digest(self, rung: Rung) -> str:
        """What every rank must agree on before it builds a rung: the points, the rung's
        depth and points, and the settings that shape rows and stamps."""
        plan = {"points": [asdict(p) for p in self._points], "config": asdict(self.config),
                "rung": {"batch": rung.batch_size, "depth": rung.depth,
                         "real": [asdict(p) for p in rung.points], "fake": [asdict(p) for p in rung.fake_points]}}
        return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()

    # --- driven by the adapter -------------------------------------------------------------

    def before_schedule(self, scheduler) -> None:
        if self.done:
            return
        if self._waiting is not None:
            records = self._exchange.poll()
            if records is None:
                time.sleep(0.001)  # the other ranks are not there yet: let them have the CPU
                return
            _raise_on_peer_failure(records)
            then, self._waiting = self._waiting, None
            then(records)
            return
        if self._rung is None:
            self._start_next_rung(scheduler)
            return
        for chain in self._rung.chains:
            if is_prefilled(chain):
                park(scheduler, chain)  # before this step could decode it further
        if self._catchups is not None and self._point is None:
            self._advance_catchups(scheduler)  # until the point's shadows are queued on them
            return
        if not all_parked(scheduler, self._rung.chains) or self._point is not None:
            return
        if not self._rung.built:
            self._record_stage()
        if self._queue and not self._queue[0].real:
            self._shed(scheduler)  # fake points need no chains, and their blocks may not fit beside them
        if self._queue:
            queued = self._queue.pop(0)
            self._meet("point", {"index": len(self.rows)}, lambda records: self._start_point(scheduler, queued, records))
        else:
            self._shed(scheduler)
            self._rung = None

    def _meet(self, kind: str, record: dict, then: Callable[[list[dict]], None]) -> None:
        """Post this rank's record for a boundary; `then` runs once every rank has posted."""
        self._exchange.post(kind, {**record, "failed": None})
        self._waiting = then

    def abandon(self, scheduler, error: str) -> None:
        """This rank's sweep stopped on `error`: give back what it holds (chains, the point's
        requests) so the engine serves on, and tell the other ranks at their next boundary
        instead of leaving them waiting."""
        from vllm.v1.request import RequestStatus

        self.done = True
        self._waiting = None
        self._exchange.post_failure(error)
        scheduler.kvwarm.drop_pending()
        ids = [r.request_id for r in self._point[1].shadows] if self._point else []
        ids += [c.request_id for c in self._rung.chains] if self._rung else []
        ids += [c.request_id for c in self._catchups.requests] if self._catchups else []
        self._point, self._catchups = None, None
        self._restore_chunks()
        live = [i for i in ids if i in scheduler.requests]
        if live:
            scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)

    def _start_point(self, scheduler, queued: QueuedPoint, records: list[dict]) -> None:
        _check_same_point(records)
        self._queue_point(scheduler, queued)

    def after_update(self, scheduler, output) -> None:
        if self._point is None:
            return
        queued, pending = self._point
        point = queued.point
        if pending.failure is not None:
            self._finish_point(_skipped(point, pending.failure), scheduler)
            return
        ids = {s.request_id for s in pending.shadows}
        scheduled = output.num_scheduled_tokens
        now = self._clock()
        if any(r.req_id in ids for r in output.scheduled_new_reqs):
            self._last_update = now  # the admission step: scaffolding, not timed
            return
        if not ids & set(scheduled):
            return
        if set(scheduled) != ids or set(scheduled.values()) != {1}:
            foreign = len(set(scheduled) - ids)
            self._mismatch = self._mismatch or (
                f"step scheduled {len(scheduled)} request(s) for a point of {len(ids)}"
                + (f", {foreign} of them not the sweep's" if foreign else ""))
        self._times.append(now - self._last_update)
        self._last_update = now
        if len(self._times) == pending.headroom:
            self._finish_point(self._row(queued, pending), scheduler)

    # --- phases ------------------------------------------------------------------------------

    def _end(self, scheduler) -> None:
        """The leak check: reset_prefix_cache() succeeds only when nothing but the null
        block is in use, so requests from outside (a server's) must be done first. They are
        waited for up to END_WAIT_SECONDS; after that the check is not made (None)."""
        if scheduler.requests:
            if self._ending is None:
                self._ending = self._clock()
            if self._clock() - self._ending < END_WAIT_SECONDS:
                return
            self._progress(f"{len(scheduler.requests)} request(s) from outside still running: "
                           "no leak check (reset_prefix_cache) this time")
        else:
            self.reset_prefix_cache_ok = scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
        self.done = True
        self._progress(f"sweep done: {len(self.rows)}/{len(self._points)} point(s)")

    def _start_next_rung(self, scheduler) -> None:
        if not self.rungs:
            self._end(scheduler)
            return
        rung = self._rung = self.rungs.pop(0)
        kvm = scheduler.kv_cache_manager
        # Where the manager keeps a watermark free when it admits waiting requests (the
        # chains are such requests), the chains cannot use those blocks.
        usable = kvm.block_pool.get_num_free_blocks() - getattr(kvm, "watermark_blocks", 0)
        self._meet("pool", {"usable_blocks": usable}, lambda records: self._plan_rung(scheduler, rung, records))

    def _plan_rung(self, scheduler, rung: Rung, records: list[dict]) -> None:
        """Every rank trims to the smallest usable pool, then the ranks compare plans."""
        if rung.depth:
            self._trim(scheduler, rung, min(r["usable_blocks"] for r in records))
        digest = self.plan_digest(rung)
        self._meet("plan", {"digest": digest}, lambda records: self._build_rung(scheduler, rung, records))

    def _build_rung(self, scheduler, rung: Rung, records: list[dict]) -> None:
        digests = {r["rank"]: r["digest"] for r in records}
        if len(set(digests.values())) > 1:
            raise RankFailed(f"plan mismatch before rung batch={rung.batch_size}: "
                             + ", ".join(f"rank {r} {d}" for r, d in sorted(digests.items())))
        rung.started = self._clock()
        self._queue = [QueuedPoint(p, True) for p in rung.points] + [QueuedPoint(p, False) for p in rung.fake_points]
        if not rung.depth:
            rung.built = True
            return
        self._progress(f"rung batch={rung.batch_size}: building {rung.batch_size} chain(s) of {rung.depth} tokens"
                       + (f" ({len(rung.fake_points)} point(s) beyond them on fake KV)" if rung.fake_points else ""))
        for i in range(rung.batch_size):
            # The salt is the chain's index, not the rung's: chain i of a later rung extends
            # the same text, so it finds the earlier chain's blocks in the prefix cache. Not
            # in place: shadows advanced those chains' state, which must not be inherited.
            name = f"b{rung.batch_size}_{i}_s{self._number}"
            salt = None if self.config.state_mode == INPLACE else f"__kvwarm_chain_{i}"
            chain = chain_request(scheduler, name, self._chain_tokens(i, rung.depth), salt=salt)
            scheduler.add_request(chain)
            rung.chains.append(chain)
        if self.config.state_mode == EXACT:
            # One state block per prefill step: every boundary state is cached for the catch-ups.
            self._chunk_cap = PrefillChunkCap(scheduler.scheduler_config,
                                              state_block_size(group_layouts(scheduler.kv_cache_manager)))
            self._chunk_cap.apply()

    def _restore_chunks(self) -> None:
        if self._chunk_cap is not None:
            self._chunk_cap.restore()
            self._chunk_cap = None

    def _trim(self, scheduler, rung: Rung, usable: int) -> None:
        layouts = group_layouts(scheduler.kv_cache_manager)
        catchup = planned_catchup_blocks(layouts) if self.config.state_mode == EXACT else 0
        rung.depth = trim_depth(layouts, rung.depth, rung.batch_size, self.config.repeats,
                                self.config.hand_off == COPY, usable, per_shadow=catchup)
        # A shadow's prompt is the chain's first ctx + 1 tokens; its steady tokens are its own.
        covered = [p for p in rung.points if max(injected_contexts(p)) + 1 <= rung.depth]
        rung.fake_points = [p for p in rung.points if p not in covered]
        rung.points = covered
        if not covered:  # nothing to borrow from: no chains at all
            rung.depth = 0

    def _record_stage(self) -> None:
        rung = self._rung
        rung.built = True
        self._restore_chunks()
        seconds = self._clock() - rung.started
        self.stages.append({"batch": rung.batch_size, "depth": rung.depth, "build_seconds": round(seconds, 3)})
        self._progress(f"rung batch={rung.batch_size}: {rung.batch_size} chain(s) built in {seconds:.1f} s")

    def _queue_point(self, scheduler, queued: QueuedPoint) -> None:
        point, config = queued.point, self.config
        contexts = injected_contexts(point)
        # Fake points below the giant-KV threshold keep the single step of the legacy path.
        repeats = config.repeats if queued.real or point.total_kv_read_tokens >= config.giant_kv_threshold else 1
        if queued.real and config.state_mode == EXACT:
            self._start_catchups(scheduler, queued, contexts, repeats)
            return
        if queued.real:
            pending = PendingPoint(self._rung.chains[: point.batch_size], contexts, headroom=repeats,
                                   fork=config.fork, state_mode=config.state_mode)
        else:
            vocab = scheduler.vllm_config.model_config.get_vocab_size()
            pending = PendingPoint(None, contexts, headroom=repeats, vocab_size=vocab)
        self._measure(scheduler, queued, pending)

    def _start_catchups(self, scheduler, queued: QueuedPoint, contexts: list[int], headroom: int) -> None:
        """Exact mode: a catch-up chain per shadow, when the pool holds them and the
        shadows beside them (else none, and the point is skipped, named, after the ranks
        meet as they would have: a rank with a smaller pool stays in step); the shadows
        follow once every catch-up stands at its context (_advance_catchups)."""
        kvm = scheduler.kv_cache_manager
        layouts = group_layouts(kvm)
        chains = self._rung.chains[: queued.point.batch_size]
        requests = [catchup_request(scheduler, chain, ctx, f"catchup{len(self.rows)}_{i}_s{self._number}")
                    for i, (chain, ctx) in enumerate(zip(chains, contexts))]
        need = sum(catchup_blocks(layouts, ctx, cached_tokens(kvm, r))
                   + shadow_private_blocks(layouts, ctx, headroom, self.config.hand_off == COPY)
                   for r, ctx in zip(requests, contexts))
        short = pool_shortfall(need, kvm.block_pool.get_num_free_blocks())
        if short:
            self._catchups = CatchUps(queued, contexts, headroom, [], short=(
                f"{POOL_EXHAUSTED}: {short} more free block(s) needed for the catch-up chains and shadows"))
            return
        for request in requests:
            scheduler.add_request(request)
        self._catchups = CatchUps(queued, contexts, headroom, requests)

    def _advance_catchups(self, scheduler) -> None:
        """Park each catch-up once its prompt is scheduled; once all are back, the ranks
        meet and the point's shadows are queued on them."""
        catchups = self._catchups
        for request in catchups.requests:
            if is_caught_up(request):
                park(scheduler, request)
        if not all_parked(scheduler, catchups.requests):
            return
        self._meet("caught_up", {"index": len(self.rows)}, lambda records: self._queue_exact(scheduler, records))

    def _queue_exact(self, scheduler, records: list[dict]) -> None:
        _check_same_point(records)
        catchups, config = self._catchups, self.config
        if catchups.short:
            self._finish_point(_skipped(catchups.queued.point, catchups.short), scheduler)
            return
        pending = PendingPoint(catchups.requests, catchups.contexts, headroom=catchups.headroom, fork=config.fork,
                               state_mode=config.state_lending,
                               prompt_chains=self._rung.chains[: catchups.queued.point.batch_size])
        self._measure(scheduler, catchups.queued, pending)

    def _measure(self, scheduler, queued: QueuedPoint, pending: PendingPoint) -> None:
        """Queue the point's requests; its admission and timed steps follow (after_update)."""
        self._point = (queued, scheduler.kvwarm.queue(pending))
        self._times, self._mismatch = [], None

    def _row(self, queued: QueuedPoint, pending: PendingPoint) -> PointRow:
        point, config = queued.point, self.config
        measured = sum(pending.contexts) + point.batch_size
        if self._mismatch:
            return PointRow(point.total_kv_read_tokens, point.batch_size, f"skip:{BATCH_SIZE_MISMATCH}",
                            detail=f"{BATCH_SIZE_MISMATCH}: {self._mismatch}")
        reasons = [CONTEXT_CLAMPED] if measured != point.total_kv_read_tokens else []
        if queued.real:
            reasons.append("kvwarm_real_kv")
            chains = self._rung.chains[: point.batch_size]
            # exact: the state stands at each shadow's context once its admission token is in
            depth = (max(pending.contexts) + 1 if config.state_mode == EXACT
                     else max(c.num_computed_tokens for c in chains))
            reasons += state_stamps(config.state_mode, depth)
            if config.state_mode == INPLACE:
                ids = {c.request_id for c in chains}
                reasons += [STATE_DRIFTED] if ids & self._drifted else []
                self._drifted |= ids
        elif config.fake_regime == FAKE_FALLBACK:
            reasons.append("kvwarm_fake_fallback")
        regime = REAL_KV if queued.real else config.fake_regime
        row = PointRow(measured, point.batch_size, regime, reasons, list(self._times),
                       statistics.median_high(self._times))
        if len(self._times) > 1 and row.spread > NOISY_SPREAD:
            row.sample_reasons.append(NOISY)
        return row

    def _finish_point(self, row: PointRow, scheduler) -> None:
        self.rows.append(row)
        self._point = None
        if self._catchups is not None:
            from vllm.v1.request import RequestStatus

            scheduler.finish_requests([r.request_id for r in self._catchups.requests], RequestStatus.FINISHED_ABORTED)
            self._catchups = None
        self._on_row(row)
        median = f"{row.median_seconds * 1e3:.2f} ms" if row.median_seconds is not None else row.kv_seed_regime
        self._progress(f"point {len(self.rows)}/{len(self._points)} K={row.total_kv_read_tokens} "
                       f"B={row.batch_size} ({row.kv_seed_regime}): {median}")

    def _shed(self, scheduler) -> None:
        from vllm.v1.request import RequestStatus

        if self._rung.chains:
            scheduler.finish_requests([c.request_id for c in self._rung.chains], RequestStatus.FINISHED_ABORTED)
            self._rung.chains = []


def _skipped(point: DecodePoint, detail: str) -> PointRow:
    """The row of a point that could not be admitted, with why."""
    return PointRow(point.total_kv_read_tokens, point.batch_size, f"skip:{POINT_SKIP_REASON}", detail=detail)


def _check_same_point(records: list[dict]) -> None:
    at = {r["rank"]: r["index"] for r in records}
    if len(set(at.values())) > 1:
        raise RankFailed(f"the ranks are at different points: {at} (rank: point index)")


def _raise_on_peer_failure(records: list[dict]) -> None:
    failed = [r for r in records if r.get("failed")]
    if failed:
        raise RankFailed("; ".join(f"rank {r['rank']} failed: {r['failed']}" for r in failed))
