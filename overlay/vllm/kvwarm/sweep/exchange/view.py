"""Rank 0's combined view under the store exchange (sweep.exchange.store): its own artifact and
every other rank's, rebuilt from their summaries and the rows they published, written to
OUT/sweep.json (record.combined) by a thread of its own, never inside `schedule()`. It reads
the store every COLLECT_SECONDS (sooner after each of rank 0's own writes), takes each rank's
new chunks of rows once and deletes them, and rewrites the view when something changed, paced
so that rewriting a long sweep's view takes at most WRITE_SHARE of the time (sweep.pacing).
Once the view is final (every rank done, or given up on: silent for the timeout after rank
0's end, or missed a boundary) the exchange's `on_final` gets every rank's artifact, then the
final view is written and the store closed.
"""

from __future__ import annotations

import threading

from vllm.logger import init_logger

from ...record import vocabulary as v
from ...record.combined import given_up, write_view
from ..pacing import Pacing
from ..ranks import RankFailed
from .records import rows_record, summary_record

logger = init_logger(__name__)

COLLECT_SECONDS = 0.5  # how often rank 0 reads the others' summaries
FETCH_BATCH = 16  # chunks read in one multi_get (each about records.CHUNK_BYTES)
WRITE_SHARE = 0.1  # at most this share of the time goes to rewriting the view (but the final write)


class CombinedView:
    """Rank 0's combined view, over its StoreExchange (`store_call`, `nonce`, `lost`,
    `unheard`, `close`, `on_final`)."""

    def __init__(self, exchange):
        self.exchange = exchange
        self.own: dict | None = None
        self.heads: dict[int, dict] = {}  # rank: its latest summary's artifact (less its rows)
        self.rows: dict[int, tuple[list, list]] = {}  # rank: its results and skipped points so far
        self.fake_rows: dict[int, tuple[list, list]] = {}  # rank: an A/B sweep's fake side's, alike
        self.fetched: dict[int, int] = {}  # rank: chunks read
        self.changed_at: dict[int, float] = {}  # rank: when its summary last changed
        self.refused: dict[str, str] = {}  # key: why its record was refused
        self.ended_at: float | None = None
        self.combined: dict | None = None
        self._raw: dict[int, bytes] = {}  # rank: its latest summary as read
        self._written = None  # what the last write was made of
        self._pacing = Pacing(WRITE_SHARE)
        self._dirty = False
        self._cond = threading.Condition()
        self.collector = threading.Thread(target=self._collect, name="kvwarm-ranks-view", daemon=True)
        self.collector.start()

    def update(self, artifact: dict) -> None:
        """Rank 0's own artifact after each of its writes (from `schedule()`: no network)."""
        with self._cond:
            self.own = artifact
            if artifact["status"] != v.RUNNING and self.ended_at is None:
                self.ended_at = self.exchange.clock()
            self._dirty = True
            self._cond.notify_all()

    @property
    def final(self) -> bool:
        return self.combined is not None and self.combined["status"] != v.RUNNING

    # --- reading the store ---------------------------------------------------------------------

    def _refuse(self, key: str, err: RankFailed) -> None:
        if self.refused.get(key) != str(err):
            self.refused[key] = str(err)
            logger.warning("[kvwarm sweep dp0] the combined view %s", err)

    def _gather(self) -> None:
        """Every other rank's latest summary, and the chunks of rows it names that are new."""
        exchange, now = self.exchange, self.exchange.clock()
        for rank in range(1, exchange.size):
            key = f"kvwarm/summary/{rank}"
            if not exchange.store_call("check", [key]):
                continue
            raw = exchange.store_call("get", key)
            if raw is None or raw == self._raw.get(rank):
                continue
            try:
                summary = summary_record(raw, key, rank, exchange.nonce)
            except RankFailed as err:
                self._refuse(key, err)
                continue
            table, fake = self.rows.setdefault(rank, ([], [])), self.fake_rows.setdefault(rank, ([], []))
            first = self.fetched.get(rank, 0)
            names = [f"kvwarm/rows/{rank}/{i}" for i in range(first, summary["chunks"])]
            for start in range(0, len(names), FETCH_BATCH):
                batch = names[start : start + FETCH_BATCH]
                for name, value in zip(batch, exchange.store_call("multi_get", batch) or []):
                    try:
                        chunk = rows_record(value, name, rank, exchange.nonce)
                    except RankFailed as err:
                        self._refuse(name, err)
                        continue
                    for i, field in enumerate(("results", "skipped_points")):
                        for entry in chunk[field]:  # an A/B sweep's rows go to their side
                            (fake if entry.get("ab") == v.AB_FAKE else table)[i].append(entry)
                for name in batch:
                    exchange.store_call("delete_key", name)
            self.fetched[rank] = summary["chunks"]
            self.heads[rank], self._raw[rank], self.changed_at[rank] = summary["artifact"], raw, now

    def _ranks(self) -> list[dict | None]:
        ranks: list[dict | None] = [self.own]
        for rank in range(1, self.exchange.size):
            head = self.heads.get(rank)
            results, skipped = self.rows.get(rank, ([], []))
            fake = dict(zip(("results", "skipped_points"), self.fake_rows.get(rank, ([], []))))
            side = {v.AB_FAKE_SIDE: fake} if any(fake.values()) else {}
            ranks.append(None if head is None else {**head, "results": results, "skipped_points": skipped, **side})
        return ranks

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
            since = max(self.changed_at.get(rank, exchange.created), self.ended_at)
            if now - since > exchange.timeout:
                lost[rank] = (
                    f"rank 0 gave up on it: nothing new from it for {exchange.timeout:.0f} s "
                    f"after rank 0's own end ({last})"
                )
        return lost

    # --- writing the view ----------------------------------------------------------------------

    def _write(self) -> None:
        if self.exchange.unheard() is None:
            self._gather()
        ranks = self._ranks()
        lost = self._lost(ranks)
        made_of = (id(self.own), self.own["status"], dict(self._raw), sorted(lost.items()))
        if made_of == self._written:
            return
        statuses = [a["status"] if a else v.RUNNING for a in ranks]
        ending = all(s != v.RUNNING or r in lost for r, s in enumerate(statuses))
        if not ending and not self._pacing.due():
            return  # a long sweep's view: written again once its last write is paid for
        began = self._pacing.clock()
        if ending:  # handed on first: whoever waits for the final view finds Dynamo's files there
            self._hand_over(ranks, lost)
        self.combined = write_view(self.exchange.root, ranks, lost)
        self._written = made_of
        self._pacing.wrote(began)

    def _collect(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._dirty, timeout=COLLECT_SECONDS)
                self._dirty = False
                if self.own is None:
                    continue
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

    def _hand_over(self, ranks: list[dict | None], lost: dict[int, str]) -> None:
        """Every rank's final record to `on_final`; a rank given up on while its own record
        still says running goes as failed with the reason, as the final view counts it (and as
        `export` from the command line reads it: record.export.input)."""
        callback = self.exchange.on_final
        if callback is None:
            return
        try:
            callback(given_up(ranks, lost))
        except Exception:
            logger.exception("[kvwarm sweep dp0] handing the final records on failed")
