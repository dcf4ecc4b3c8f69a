"""Rank 0's combined view under the store exchange (sweep.exchange.store): its own artifact and
every other rank's, rebuilt from their summaries and the rows they published, written to
OUT/sweep.json (record.combined.RunningView) by a thread of its own, never inside `schedule()`.
It reads the store every COLLECT_SECONDS (sooner after each of rank 0's own writes), takes
each rank's new chunks of rows once and deletes them, and rewrites the view when something
changed, paced so that rewriting a long sweep's view takes at most WRITE_SHARE of the time
(sweep.pacing).

While rank 0's sweep runs, the thread reads and writes only between rank 0's points: it waits
for rank 0's next boundary (each meeting the controller posts, at the end of every point and
before any timed step of the next), so its work never competes with rank 0's timed steps for
the interpreter. A rewrite costs the encoding of the rows that arrived since the last one and
the joining of the rest (RunningView), so it fits in that gap however long the sweep.

A failure to read or write the view is logged and the view written again at its next turn: a
convenience output never stops the measurement. Once the view is final (every rank done, or
given up on: silent for the timeout after rank 0's end, or missed a boundary) the exchange's
`on_final` gets every rank's artifact, then the final view is written and the store closed.
"""

from __future__ import annotations

import threading

from vllm.logger import init_logger

from ...record import vocabulary as v
from ...record.artifact import row_lists, without_rows
from ...record.combined import RunningView, given_up
from ..pacing import Pacing
from ..ranks import RankFailed
from .records import rows_record, summary_record

logger = init_logger(__name__)

COLLECT_SECONDS = 0.5  # how often rank 0 reads the others' summaries
BOUNDARY_SECONDS = 5.0  # how long a write waits for rank 0's next boundary before it tries again
FETCH_BATCH = 16  # chunks read in one multi_get (each about records.CHUNK_BYTES)
WRITE_SHARE = 0.1  # at most this share of the time goes to rewriting the view (but the final write)


class CombinedView:
    """Rank 0's combined view, over its StoreExchange (`store_call`, `nonce`, `given_up`,
    `unheard`, `close`, `on_final`)."""

    def __init__(self, exchange):
        self.exchange = exchange
        self.view = RunningView(exchange.size)
        self.fetched: dict[int, int] = {}  # rank: chunks read
        self.changed_at: dict[int, float] = {}  # rank: when its summary last changed
        self.refused: dict[str, str] = {}  # key: why its record was refused
        self.ended_at: float | None = None
        self.status: str | None = None  # the view's as last written
        self._own: dict | None = None  # rank 0's latest artifact, until the view takes its new rows
        self._raw: dict[int, bytes] = {}  # rank: its latest summary as read
        self._version = 0  # counts what changed: rank 0's writes and the others' summaries
        self._written = None  # what the last write was made of
        self._handed = False  # the final records went to on_final
        self._failure: str | None = None  # the last write's failure, while it lasts
        self._pacing = Pacing(WRITE_SHARE)
        self._dirty = False
        self._between = threading.Event()  # set at each of rank 0's boundaries
        self._cond = threading.Condition()
        self.collector = threading.Thread(target=self._collect, name="kvwarm-ranks-view", daemon=True)
        self.collector.start()

    def update(self, artifact: dict) -> None:
        """Rank 0's own artifact after each of its writes (from `schedule()`: no network)."""
        with self._cond:
            self._own = artifact
            if artifact["status"] != v.RUNNING and self.ended_at is None:
                self.ended_at = self.exchange.clock()
            self._dirty = True
            self._cond.notify_all()

    def between_points(self) -> None:
        """Rank 0 is at a boundary (from `schedule()`): no timed step runs until its next point
        is admitted, the view's turn."""
        self._between.set()

    @property
    def heads(self) -> dict[int, dict]:
        """Every other rank's latest summary's artifact (less its rows), by rank."""
        return {r: head for r, head in enumerate(self.view.heads) if r and head is not None}

    @property
    def final(self) -> bool:
        return self.status not in (None, v.RUNNING)

    # --- reading the store ---------------------------------------------------------------------

    def _refuse(self, key: str, err: RankFailed) -> None:
        if self.refused.get(key) != str(err):
            self.refused[key] = str(err)
            logger.warning("[kvwarm sweep dp0] the combined view %s", err)

    def _take_own(self) -> bool:
        """Rank 0's rows added since the view last took them; whether rank 0 has written."""
        with self._cond:
            own, self._own = self._own, None
        if own is not None:  # an A/B sweep's fake side's rows say their side (`ab`)
            taken = [len(rows) for side in (self.view.table, self.view.fake) for rows in side.rows[0]]
            results, skipped, fake_results, fake_skipped = (rows[n:] for rows, n in zip(row_lists(own), taken))
            self.view.take(0, without_rows(own), results + fake_results, skipped + fake_skipped)
            self._version += 1
        return self.view.heads[0] is not None

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
            results, skipped = [], []
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
                    results += chunk["results"]
                    skipped += chunk["skipped_points"]
                for name in batch:
                    exchange.store_call("delete_key", name)
            self.fetched[rank] = summary["chunks"]
            self.view.take(rank, summary["artifact"], results, skipped)
            self._raw[rank], self.changed_at[rank] = raw, now
            self._version += 1

    def _lost(self) -> dict[int, str]:
        """The ranks given up on: those that missed one of rank 0's boundaries, and, after
        rank 0's own end, those silent for the timeout since (or that cannot be heard at all)."""
        exchange = self.exchange
        lost = {rank: f"rank 0 gave up on it: {why}" for rank, why in exchange.given_up().items()}
        if self.ended_at is None:
            return lost
        now = exchange.clock()
        for rank in range(1, exchange.size):
            head = self.view.heads[rank]
            if rank in lost or (head and head["status"] != v.RUNNING):
                continue
            last = (
                f"its last record: {head['status']}, {len(self.view.rows[rank][0])} row(s)"
                if head
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

    def _write(self) -> bool:
        """Whether the view was written (not: nothing changed, or its pace holds it back)."""
        if not self._take_own():
            return False
        if self.exchange.unheard() is None:
            self._gather()
        lost = self._lost()
        made_of = (self._version, sorted(lost.items()))
        if made_of == self._written:
            return False
        statuses = [head["status"] if head else v.RUNNING for head in self.view.heads]
        ending = all(s != v.RUNNING or r in lost for r, s in enumerate(statuses))
        if not ending and not self._pacing.due():
            return False  # a long sweep's view: written again once its last write is paid for
        began = self._pacing.clock()
        if ending and not self._handed:  # handed on first: whoever waits for the final view finds Dynamo's files
            self._handed = True
            self._hand_over(lost)
        self.status = self.view.write(self.exchange.root, lost)
        self._written = made_of
        self._pacing.wrote(began)
        return True

    def _turn(self) -> bool:
        """Whether the view may be read and written now: rank 0's sweep has ended, or rank 0
        has just reached a boundary (waited for, up to BOUNDARY_SECONDS)."""
        if self.ended_at is not None:
            return True
        self._between.clear()  # a boundary from before this wait may be over by now
        return self._between.wait(BOUNDARY_SECONDS)

    def _collect(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._dirty, timeout=COLLECT_SECONDS)
                self._dirty = False
            if not self._turn():
                continue
            try:
                wrote = self._write()
            except Exception as err:  # noqa: BLE001  (the view is retried; the sweep goes on)
                self._failed(err)
                continue
            if wrote and self._failure is not None:
                logger.info("[kvwarm sweep dp0] the combined view at %s is written again", self.exchange.root)
                self._failure = None
            if self.final:
                self.exchange.close()
                return

    def _failed(self, err: Exception) -> None:
        """A failed read or write of the view: logged (once while it keeps failing the same
        way); the view stays as it was and is written again at the next turn."""
        why = f"{type(err).__name__}: {err}"
        if why != self._failure:
            logger.exception(
                "[kvwarm sweep dp0] writing the combined view to %s failed; the sweep goes on and the view is "
                "written again at its next turn",
                self.exchange.root,
            )
        self._failure = why

    def _hand_over(self, lost: dict[int, str]) -> None:
        """Every rank's final record to `on_final`; a rank given up on while its own record
        still says running goes as failed with the reason, as the final view counts it (and as
        `export` from the command line reads it: record.export.input)."""
        callback = self.exchange.on_final
        if callback is None:
            return
        try:
            callback(given_up(self.view.artifacts(), lost))
        except Exception:
            logger.exception("[kvwarm sweep dp0] handing the final records on failed")
