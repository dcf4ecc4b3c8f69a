"""The decode sweep as a plain controller that the scheduler adapter drives.

Phases, per rung (one batch size, deepest rung first):
  build   add B chains of the rung's depth, let vLLM prefill them, park them;
  points  per point: queue its B shadows (one token short of each context), let the
          admission step run untimed, time `repeats` steady steps (the gap between
          consecutive update_from_output calls), keep every time and the median;
          the shadows then finish by length;
  shed    finish the rung's chains.
At the end the prefix cache is reset (the leak check: it only succeeds when nothing but
the null block is in use).

The adapter calls `before_schedule(scheduler)` at the start of each schedule() and
`after_update(scheduler, output)` after each update_from_output(); `has_work()` keeps
the engine stepping. Nothing here imports the engine; tests step it against a real
Scheduler with the model runner's part played by the test.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .borrowing import POINT_SKIP_REASON
from .chains import chain_request, is_prefilled, park
from .injection import PendingPoint
from .points import DecodePoint

BATCH_SIZE_MISMATCH = "measured_batch_size_mismatch"


@dataclass
class PointRow:
    total_kv_read_tokens: int
    batch_size: int
    kv_seed_regime: str  # real_kv | skip:<reason>
    sample_reasons: list[str] = field(default_factory=list)
    steady_seconds: list[float] = field(default_factory=list)
    median_seconds: float | None = None
    detail: str | None = None  # why a point was skipped, in words


@dataclass
class Rung:
    batch_size: int
    depth: int
    points: list[DecodePoint]
    chains: list = field(default_factory=list)


def plan_rungs(points: list[DecodePoint], repeats: int, max_model_len: int) -> list[Rung]:
    """One rung per batch size, deepest first; a rung's chains cover its deepest point
    plus the admission token and the steady steps (within max_model_len)."""
    by_batch: dict[int, list[DecodePoint]] = {}
    for point in points:
        by_batch.setdefault(point.batch_size, []).append(point)
    rungs = []
    for batch, rung_points in sorted(by_batch.items(), reverse=True):
        rung_points.sort(key=lambda p: p.total_kv_read_tokens, reverse=True)
        depth = max(p.contexts()[0] for p in rung_points) + 1 + repeats
        rungs.append(Rung(batch, min(depth, max_model_len - 1), rung_points))
    return rungs


class DecodeSweep:
    def __init__(self, points: list[DecodePoint], chain_tokens: Callable[[int, int], list[int]], *,
                 repeats: int, max_model_len: int, state_mode: str | None = None, fork: bool | None = None,
                 clock: Callable[[], float] = time.perf_counter, progress: Callable[[str], None] = print):
        self.rungs = plan_rungs(points, repeats, max_model_len)
        self.rows: list[PointRow] = []
        self._chain_tokens, self._repeats = chain_tokens, repeats
        self._state_mode, self._fork = state_mode, fork
        self._clock, self._progress = clock, progress
        self._total = len(points)
        self._rung: Rung | None = None
        self._queue: list[DecodePoint] = []
        self._point: tuple[DecodePoint, PendingPoint] | None = None
        self._times: list[float] = []
        self._last_update: float | None = None
        self._mismatch: str | None = None
        self.done = False
        self.reset_prefix_cache_ok: bool | None = None

    def has_work(self) -> bool:
        return not self.done

    # --- driven by the adapter -------------------------------------------------------------

    def before_schedule(self, scheduler) -> None:
        if self.done:
            return
        if self._rung is None:
            self._start_next_rung(scheduler)
            return
        for chain in self._rung.chains:
            if is_prefilled(chain):
                park(scheduler, chain)  # before this step could decode it further
        if not self._all_parked(scheduler) or self._point is not None:
            return
        if self._queue:
            self._queue_point(scheduler, self._queue.pop(0))
        else:
            self._shed(scheduler)

    def after_update(self, scheduler, output) -> None:
        if self._point is None:
            return
        point, pending = self._point
        if pending.failure is not None:
            self._finish_point(PointRow(point.total_kv_read_tokens, point.batch_size,
                                        f"skip:{POINT_SKIP_REASON}", detail=pending.failure))
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
            self._mismatch = self._mismatch or f"{BATCH_SIZE_MISMATCH}: step scheduled {len(scheduled)} request(s)"
        self._times.append(now - self._last_update)
        self._last_update = now
        if len(self._times) == self._repeats:
            self._finish_point(self._row(point))

    # --- phases ------------------------------------------------------------------------------

    def _all_parked(self, scheduler) -> bool:
        return all(is_prefilled(c) and c not in scheduler.running for c in self._rung.chains)

    def _start_next_rung(self, scheduler) -> None:
        if not self.rungs:
            self.done = True
            self.reset_prefix_cache_ok = scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
            self._progress(f"sweep done: {len(self.rows)}/{self._total} point(s)")
            return
        self._rung = self.rungs.pop(0)
        self._progress(f"rung batch={self._rung.batch_size}: building {self._rung.batch_size} chain(s) "
                       f"of {self._rung.depth} tokens")
        for i in range(self._rung.batch_size):
            chain = chain_request(scheduler, f"b{self._rung.batch_size}_{i}",
                                  self._chain_tokens(i, self._rung.depth))
            scheduler.add_request(chain)
            self._rung.chains.append(chain)
        self._queue = list(self._rung.points)

    def _queue_point(self, scheduler, point: DecodePoint) -> None:
        # One token short: the admission step computes each context's last token, so the
        # steady steps read exactly K tokens of KV between them.
        contexts = [c - 1 for c in point.contexts()]
        chains = self._rung.chains[: point.batch_size]
        pending = scheduler.kvwarm.queue(PendingPoint(
            chains, contexts, headroom=self._repeats, fork=self._fork, state_mode=self._state_mode))
        self._point, self._times, self._mismatch = (point, pending), [], None

    def _row(self, point: DecodePoint) -> PointRow:
        if self._mismatch:
            return PointRow(point.total_kv_read_tokens, point.batch_size,
                            f"skip:{self._mismatch.split(':')[0]}", detail=self._mismatch)
        reasons = ["kvwarm_real_kv"]
        if self._state_mode:
            depth = max(c.num_computed_tokens for c in self._rung.chains[: point.batch_size])
            reasons += [f"kvwarm_state_{self._state_mode}", f"kvwarm_state_depth={depth}"]
        return PointRow(point.total_kv_read_tokens, point.batch_size, "real_kv", reasons,
                        list(self._times), statistics.median(self._times))

    def _finish_point(self, row: PointRow) -> None:
        self.rows.append(row)
        self._point = None
        median = f"{row.median_seconds * 1e3:.2f} ms" if row.median_seconds is not None else row.kv_seed_regime
        self._progress(f"point {len(self.rows)}/{self._total} K={row.total_kv_read_tokens} "
                       f"B={row.batch_size}: {median}")

    def _shed(self, scheduler) -> None:
        from vllm.v1.request import RequestStatus

        scheduler.finish_requests([c.request_id for c in self._rung.chains], RequestStatus.FINISHED_ABORTED)
        self._rung = None
