"""Python's garbage collector held still while a sweep times its steps.

A generation-2 collection inside a timed step is a wrong row (long sweeps saw them grow from
0.4 s to 9 s). So, unless DYN_BENCH_KV_WARMUP_GC=off: after a rung's chains are built (or,
with no chains, before the first point) what is alive is frozen, after a collection as vLLM's
own freeze_gc_heap does (gc.freeze: later collections skip it; garbage alive at that moment
is freed first, never frozen), collection is off while a point's requests are admitted and
timed, and a collection runs between points, untimed, followed by a freeze of what survived
it: each collection scans only what the point just measured left, never the rows and records
of the points before (a sweep's cost per point stays flat however long it runs).

At the end the engine's policy is put back: collection on or off as it was, and the sweep's
freezes undone. Python thaws only everything at once, so the heap is unfrozen and, where the
engine had frozen its own at start (vLLM's EngineCore always does), collected and frozen again
as freeze_gc_heap leaves it: the garbage of the sweep is freed and the engine keeps a frozen
heap.

Each action also runs in the executor's worker processes (`workers`, sweep.gc_workers), where
tensor-parallel forwards run; the record gives each kind of process's policy.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Protocol

HOLD, ENGINE = "held", "engine"  # the record's policy: the sweep's, or left as the engine had it
UNFROZEN, REFROZEN = "unfrozen", "refrozen"  # the heap at the end: thawed, or thawed, collected and frozen again


class Workers(Protocol):
    def run(self, action: str) -> None: ...

    def record(self) -> dict: ...


@dataclass
class GcHold:
    enabled: bool = True  # False: the sweep never touches the collector
    workers: Workers | None = None  # the executor's worker processes, where they are reached
    _was_enabled: bool | None = None
    _engine_frozen: int = 0
    _froze: bool = False
    _held: bool = False
    _heap_at_end: str | None = None
    collections: int = 0  # run between points
    collection_seconds: float = 0.0

    def start(self) -> None:
        if self.enabled and self._was_enabled is None:
            self._was_enabled, self._engine_frozen = gc.isenabled(), gc.get_freeze_count()

    def freeze(self) -> None:
        """After a rung's chains are built: what is alive now is never collected again here."""
        if self.enabled:
            self.start()
            gc.collect()
            gc.freeze()
            self._froze = True
            self._tell("freeze")

    def hold(self) -> None:
        """Before a point's requests are queued: no collection until release()."""
        if self.enabled:
            if not self._froze:  # no chains (fake KV): else each release scans the engine's heap
                self.freeze()
            gc.disable()
            self._held = True
            self._tell("hold")

    def release(self) -> None:
        """After a point: collect now, untimed, and freeze what survived (the next collection
        scans only what comes after), then collection as the engine had it."""
        if not self._held:
            return
        started = time.perf_counter()
        gc.collect()
        gc.freeze()
        self.collection_seconds += time.perf_counter() - started
        self.collections += 1
        self._held = False
        if self._was_enabled:
            gc.enable()
        self._tell("release")

    def end(self) -> None:
        """The engine's policy back (also after a failure)."""
        if not self.enabled or self._was_enabled is None:
            return
        self._held = False
        if self._froze:
            gc.unfreeze()
            self._heap_at_end = UNFROZEN
            if self._engine_frozen:
                gc.collect()
                gc.freeze()
                self._heap_at_end = REFROZEN
            self._froze = False
        if self._was_enabled:
            gc.enable()
        else:
            gc.disable()
        self._tell("end")

    def _tell(self, action: str) -> None:
        if self.workers is not None:
            self.workers.run(action)

    def record(self) -> dict:
        """This process's policy (the scheduler's, or a worker's), and the workers' where
        they were reached."""
        record = {
            "policy": HOLD if self.enabled else ENGINE,
            "collections_between_points": self.collections,
            "collection_seconds": round(self.collection_seconds, 6),
            "engine_froze_heap": bool(self._engine_frozen) if self._was_enabled is not None else None,
            "heap_at_end": self._heap_at_end,
        }
        if self.enabled and self.workers is not None:
            record["workers"] = self.workers.record()
        return record
