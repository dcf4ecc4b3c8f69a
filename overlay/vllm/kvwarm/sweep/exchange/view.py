"""Rank 0's combined view under the store exchange (sweep.exchange.store): its own artifact
and every other rank's latest from the store, written to OUT/sweep.json (record.combined)
after each of its own writes and, once its own sweep has ended, by a thread of its own until
the view is final (every rank done, or given up on: silent for the timeout after rank 0's
end, or missed a boundary); then the store is closed."""

from __future__ import annotations

import json
import threading
import time

from vllm.logger import init_logger

from ...record import vocabulary as v
from ...record.combined import write_view

logger = init_logger(__name__)

COLLECT_SECONDS = 0.5  # how often rank 0 gathers the others' records after its own end


class CombinedView:
    """Rank 0's combined view, over its StoreExchange (`fetch_artifacts`, `lost`, `unheard`,
    `close`)."""

    def __init__(self, exchange):
        self.exchange = exchange
        self.own: dict | None = None
        self.seen: dict[int, tuple[bytes, dict, float]] = {}  # rank: (record, parsed, when it last changed)
        self.ended_at: float | None = None
        self.combined: dict | None = None
        self.collector: threading.Thread | None = None
        self._written = None  # what the last write was made of
        self._lock = threading.Lock()

    def update(self, artifact: dict) -> None:
        with self._lock:
            self.own = artifact
            if artifact["status"] != v.RUNNING and self.ended_at is None:
                self.ended_at = self.exchange.clock()
            self._write(force=True)
            if self.ended_at is None or self.collector is not None:
                return
            if self.final:
                self.exchange.close()
                return
            self.collector = threading.Thread(target=self._collect, name="kvwarm-ranks-view", daemon=True)
            self.collector.start()

    @property
    def final(self) -> bool:
        return self.combined is not None and self.combined["status"] != v.RUNNING

    def _gather(self) -> list[dict | None]:
        now = self.exchange.clock()
        for rank, value in self.exchange.fetch_artifacts().items():
            if rank not in self.seen or self.seen[rank][0] != value:
                self.seen[rank] = (value, json.loads(value), now)
        return [self.own] + [self.seen[r][1] if r in self.seen else None for r in range(1, self.exchange.size)]

    def _lost(self, ranks: list[dict | None]) -> dict[int, str]:
        """The ranks given up on: those that missed one of rank 0's boundaries, and, after
        rank 0's own end, those silent for the timeout since (or that cannot be heard at all)."""
        exchange = self.exchange
        lost = {rank: f"rank 0 gave up on it: {why}" for rank, why in exchange.lost.items()}
        if self.ended_at is None:
            return lost
        now = exchange.clock()
        for rank in range(1, exchange.size):
            artifact = ranks[rank]
            if rank in lost or (artifact and artifact["status"] != v.RUNNING):
                continue
            last = (
                f"its last record: {artifact['status']}, {len(artifact['results'])} row(s)"
                if artifact
                else "it sent no record"
            )
            unheard = exchange.unheard()
            if unheard:
                lost[rank] = f"rank 0 cannot hear from it ({last}): {unheard}"
                continue
            since = max(self.seen[rank][2] if rank in self.seen else exchange.created, self.ended_at)
            if now - since > exchange.timeout:
                lost[rank] = (
                    f"rank 0 gave up on it: nothing new from it for {exchange.timeout:.0f} s "
                    f"after rank 0's own end ({last})"
                )
        return lost

    def _write(self, force: bool = False) -> None:
        ranks = self._gather()
        lost = self._lost(ranks)
        made_of = (
            [self.seen[r][0] if r in self.seen else None for r in range(1, self.exchange.size)],
            sorted(lost.items()),
        )
        if not force and made_of == self._written:
            return
        self.combined = write_view(self.exchange.root, ranks, lost)
        self._written = made_of

    def _collect(self) -> None:
        while True:
            time.sleep(COLLECT_SECONDS)
            with self._lock:
                try:
                    self._write()
                except Exception:
                    logger.exception(
                        "[kvwarm sweep dp0] writing the combined view to %s failed; it stays as it was",
                        self.exchange.root,
                    )
                    self.exchange.close()
                    return
                if self.final:
                    self.exchange.close()
                    return
