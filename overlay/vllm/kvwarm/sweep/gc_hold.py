"""Python's garbage collector held still while a sweep times its steps.

A generation-2 collection inside a timed step is a wrong row (long sweeps saw them grow from
0.4 s to 9 s). So, unless DYN_BENCH_KV_WARMUP_GC=off: after a rung's chains are built (or,
with no chains, before the first point) the objects that exist are frozen (gc.freeze: later
collections skip them, so the one between points is short), collection is off
while a point's requests are admitted and timed, and a collection runs between points,
untimed. At the end the engine's policy is put back: collection on or off as it was, and the
frozen objects unfrozen unless the engine had frozen some itself (which it may rely on).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

HOLD, ENGINE = "held", "engine"  # the record's policy: the sweep's, or left as the engine had it


@dataclass
class GcHold:
    enabled: bool = True  # False: the sweep never touches the collector
    _was_enabled: bool | None = None
    _engine_frozen: int = 0
    _froze: bool = False
    _held: bool = False
    collections: int = 0  # run between points
    collection_seconds: float = 0.0

    def start(self) -> None:
        if self.enabled and self._was_enabled is None:
            self._was_enabled, self._engine_frozen = gc.isenabled(), gc.get_freeze_count()

    def freeze(self) -> None:
        """After a rung's chains are built: what exists now is never collected again here."""
        if self.enabled:
            self.start()
            gc.freeze()
            self._froze = True

    def hold(self) -> None:
        """Before a point's requests are queued: no collection until release()."""
        if self.enabled:
            if not self._froze:  # no chains (fake KV): else each release scans the engine's heap
                self.freeze()
            gc.disable()
            self._held = True

    def release(self) -> None:
        """After a point: collect now, untimed, then collection as the engine had it."""
        if not self._held:
            return
        started = time.perf_counter()
        gc.collect()
        self.collection_seconds += time.perf_counter() - started
        self.collections += 1
        self._held = False
        if self._was_enabled:
            gc.enable()

    def end(self) -> None:
        """The engine's policy back (also after a failure)."""
        if not self.enabled or self._was_enabled is None:
            return
        self._held = False
        if self._froze and not self._engine_frozen:
            gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        else:
            gc.disable()

    def record(self) -> dict:
        return {
            "policy": HOLD if self.enabled else ENGINE,
            "collections_between_points": self.collections,
            "collection_seconds": round(self.collection_seconds, 6),
        }
