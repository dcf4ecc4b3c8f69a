"""The ranks' meetings at the sweep's boundaries (sweep.controller): this rank posts its record
through the exchange (sweep.exchange), polls at each schedule() until every rank's is there,
then runs what waited on them. A rank that posted a failure stops the others (RankFailed).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .ranks import RankFailed


class Meetings:
    def __init__(self, exchange):
        self.exchange = exchange
        self._then: Callable[[list[dict]], None] | None = None  # what runs once the ranks meet

    def post(self, kind: str, record: dict, then: Callable[[list[dict]], None]) -> None:
        """Post this rank's record for a boundary; `then` runs once every rank has posted."""
        self.exchange.post(kind, {**record, "failed": None})
        self._then = then

    def poll(self) -> None:
        """At a schedule(): run what waited on the meeting once every rank is there."""
        records = self.exchange.poll()
        if records is None:
            time.sleep(0.001)  # the other ranks are not there yet: let them have the CPU
            return
        _raise_on_peer_failure(records)
        then, self._then = self._then, None
        then(records)

    def fail(self, error: str) -> None:
        """This rank stopped on `error`: nothing waits any more, and the others are told at
        their next boundary instead of left waiting."""
        self._then = None
        self.exchange.post_failure(error)


def check_same_point(records: list[dict]) -> None:
    at = {r["rank"]: r["index"] for r in records}
    if len(set(at.values())) > 1:
        raise RankFailed(f"the ranks are at different points: {at} (rank: point index)")


def _raise_on_peer_failure(records: list[dict]) -> None:
    failed = [r for r in records if r.get("failed")]
    if failed:
        raise RankFailed("; ".join(f"rank {r['rank']} failed: {r['failed']}" for r in failed))
