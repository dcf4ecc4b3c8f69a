"""The ranks' meetings at the sweep's boundaries (sweep.controller): this rank posts its record
through the exchange (sweep.exchange), polls at each schedule() until every rank's is there,
then runs what waited on them. A rank that posted a failure stops the others (RankFailed); a
record without the fields its kind carries is refused by name (the exchange has checked its
rank, its kind and its launch already: sweep.exchange.records).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .exchange.records import FAILURE
from .ranks import RankFailed

# What each kind of meeting's record carries: field and type (integers are whole, never bools).
BODIES: dict[str, dict[str, type]] = {
    "grid": {"num_blocks": int, "kv_cache_tokens": int, "usable_blocks": int},  # the pool a --grid is laid in
    "pool": {"usable_blocks": int},  # a rung's free pool
    "plan": {"digest": str},  # a rung's plan
    "point": {"index": int, "restage": bool},  # a point's start (a prefill point: its chains to rebuild)
    "caught_up": {"index": int},  # exact state: a point's catch-ups parked
    "resume": {"done": list},  # a resumed sweep: the points this rank finished, as [start, end) runs
}
IDLE_SLEEP = 0.001  # seconds a rank with nothing else to run sleeps while it waits


class Meetings:
    def __init__(self, exchange):
        self.exchange = exchange
        self._kind: str | None = None
        self._then: Callable[[list[dict]], None] | None = None  # what runs once the ranks meet

    def post(self, kind: str, record: dict, then: Callable[[list[dict]], None]) -> None:
        """Post this rank's record for a boundary; `then` runs once every rank has posted."""
        self.exchange.post(kind, {**record, "failed": None})
        self._kind, self._then = kind, then

    def poll(self, busy: bool = False) -> None:
        """At a schedule(): run what waited on the meeting once every rank is there. `busy`:
        the scheduler has other requests to run, so a waiting rank does not sleep."""
        records = self.exchange.poll()
        if records is None:
            if not busy:
                time.sleep(IDLE_SLEEP)  # the other ranks are not there yet: let them have the CPU
            return
        _raise_on_peer_failure(records)
        for record in records:
            check_body(record, self._kind)
        then, self._then = self._then, None
        then(records)

    def fail(self, error: str) -> None:
        """This rank stopped on `error`: nothing waits any more, and the others are told at
        their next boundary instead of left waiting."""
        self._then = None
        self.exchange.post_failure(error)


def check_body(record: dict, kind: str) -> None:
    """The fields a record of `kind` carries, each of its type; RankFailed naming what is wrong."""
    for field, kind_of in BODIES.get(kind, {}).items():
        value = record.get(field)
        if kind_of is int:
            ok, what = isinstance(value, int) and not isinstance(value, bool) and value >= 0, "a whole number"
        else:
            ok, what = isinstance(value, kind_of), f"a {kind_of.__name__}"
        if not ok:
            raise RankFailed(
                f"refused rank {record.get('rank')}'s {kind} record: its {field!r} is {value!r}, not {what}"
            )


def usable_blocks(kv_cache_manager) -> int:
    """The blocks a rung's chains could take now: the free ones, less the watermark a manager
    keeps free when it admits waiting requests (the chains are such requests)."""
    free = kv_cache_manager.block_pool.get_num_free_blocks()
    return free - getattr(kv_cache_manager, "watermark_blocks", 0)


def pool_record(scheduler) -> dict:
    """This rank's pool, as a grid is laid in it (BODIES["grid"]): its blocks, the tokens they
    hold, the blocks usable now."""
    from .provenance import kv_cache_tokens

    return {
        "num_blocks": scheduler.kv_cache_config.num_blocks,
        "kv_cache_tokens": kv_cache_tokens(scheduler) or 0,
        "usable_blocks": usable_blocks(scheduler.kv_cache_manager),
    }


def has_others(scheduler) -> bool:
    """Whether the scheduler has requests to run (a server's): a rank waiting at a meeting
    then does not sleep."""
    waiting = any(getattr(scheduler, name, None) for name in ("waiting", "skipped_waiting"))
    return bool(scheduler.running) or waiting


def check_same_point(records: list[dict]) -> None:
    at = {r["rank"]: r["index"] for r in records}
    if len(set(at.values())) > 1:
        raise RankFailed(f"the ranks are at different points: {at} (rank: point index)")


def _raise_on_peer_failure(records: list[dict]) -> None:
    failed = [r for r in records if r.get("kind") == FAILURE or r.get("failed")]
    if failed:
        raise RankFailed("; ".join(f"rank {r['rank']} failed: {r.get('failed')}" for r in failed))
