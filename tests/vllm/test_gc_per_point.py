"""The collection between a sweep's points scans only what the point just measured left: what
survives it is frozen, so the objects a collection can reach (the collector's generations)
stay as many at the 80th point as at the 10th, while the rows and records of the points
before accumulate (a full collection over them made a long sweep's cost per point grow)."""

from __future__ import annotations

import gc
import itertools
import json

from kvwarm_testing.real_kv import make_scheduler, step_scheduler
from vllm.kvwarm.scheduler import KvWarmScheduler
from vllm.kvwarm.sweep.phase import Phase


def _collectable() -> int:
    """Objects a collection scans now: those in the collector's generations (not frozen)."""
    return sum(len(gc.get_objects(generation)) for generation in range(3))


def test_what_a_collection_between_points_scans_does_not_grow_with_the_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    points = tmp_path / "points.json"
    decode = [{"total_kv_read_tokens": 4 + i, "batch_size": 1 + i % 2} for i in range(80)]
    points.write_text(json.dumps({"schema_version": 1, "decode": decode}))
    spec = {"points": str(points), "out": str(tmp_path / "out")}
    scheduler = make_scheduler(tmp_path, scheduler_cls=KvWarmScheduler, additional_config={"kvwarm_sweep": spec})
    sweep, seen = scheduler.kvwarm_sweep, {}
    for _ in itertools.takewhile(lambda _: scheduler.has_requests(), range(5000)):
        step_scheduler(scheduler)
        if sweep.phase is Phase.MEASURING and len(sweep.rows) not in seen:
            seen[len(sweep.rows)] = _collectable()  # as the point's first step ran: what its collection will scan
    assert sweep.done and len(sweep.rows) == 80 and len(seen) == 80
    early, late = seen[10], seen[79]
    assert late - early < 100, (early, late)  # flat: 69 points' rows and records later
    assert gc.get_freeze_count() == 0  # the sweep's freezes undone at its end
