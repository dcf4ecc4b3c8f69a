"""A long data-parallel sweep through the store exchange: 10,000 points on each of two ranks
(fake KV, real schedulers stepped in turn, a real TCPStore on 127.0.0.1, each rank's OUT its
own) completes with its combined view, and no value set on the store passes 1 MiB.

Minutes of a busy two-core host (docs/measurements/data-parallel.md); `-m long_sweep` selects it, and
unit-S leaves it out (the integrator runs it: `nox -s unit-S -- -m long_sweep tests/vllm`)."""

from __future__ import annotations

import os
import time
from typing import ClassVar

import pytest
from kvwarm_testing.rank_sweeps import artifacts, rank_runs, view
from kvwarm_testing.real_kv import step_scheduler
from torch.distributed import TCPStore
from vllm.kvwarm.sweep.exchange import store as store_module

pytestmark = pytest.mark.long_sweep

POINTS = int(os.environ.get("KVWARM_LONG_SWEEP_POINTS", "10000"))
MIB = 1 << 20


class RecordingStore(TCPStore):
    """torch's TCPStore, noting the size of every value set through it (every rank's)."""

    sizes: ClassVar[list[int]] = []

    def set(self, key, value):
        RecordingStore.sizes.append(len(value))
        return super().set(key, value)


def _points(count: int) -> list[tuple[int, int]]:
    """`count` distinct decode points (K, B): each request's context and steps within
    max_model_len 1024, every point's blocks within a pool of 128 blocks of 16 tokens."""
    points = [(k, b) for b in range(1, 9) for k in range(2 * b, min(1000 * b, 1500))]
    assert len(points) >= count
    return points[:count]


def test_a_ten_thousand_point_sweep_on_two_ranks_completes_with_no_store_value_over_1_mib(tmp_path, monkeypatch):
    RecordingStore.sizes = []
    monkeypatch.setattr(store_module, "TCPStore", RecordingStore)
    points = _points(POINTS)
    schedulers, out = rank_runs(tmp_path, monkeypatch, points, timeout=600)
    started = time.monotonic()
    for _ in range(100 * POINTS):
        busy = [s for s in schedulers if s.has_requests()]
        if not busy:
            break
        for scheduler in busy:
            step_scheduler(scheduler)
    combined = view(schedulers[0])
    seconds = time.monotonic() - started
    per_rank, _ = artifacts(out, "store")
    assert [a["status"] for a in per_rank] == ["complete", "complete"]
    assert [len(a["results"]) for a in per_rank] == [POINTS, POINTS]
    assert combined["status"] == "complete" and len(combined["results"]) == POINTS
    assert [(r["rank"], r["rows"]) for r in combined["ranks"]] == [(0, POINTS), (1, POINTS)]
    assert RecordingStore.sizes and max(RecordingStore.sizes) <= MIB
    print(
        f"\n{POINTS} points on 2 ranks in {seconds:.0f} s; {len(RecordingStore.sizes)} values set, largest "
        f"{max(RecordingStore.sizes)} bytes"
    )
