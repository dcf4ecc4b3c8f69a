"""A long data-parallel sweep through the store exchange: 10,000 points on each of two ranks
(fake KV, real schedulers stepped in turn, a real TCPStore on 127.0.0.1, each rank's OUT its
own) completes with its combined view, no value set on the store passes 1 MiB, and its cost per
row stays flat: the first and the last decile's points, each swept again from fresh, took no
less than 0.9 of the time per row in the long sweep's last decile that they took in its first
(kvwarm_testing.campaign). It prints what benchmarks/campaign_scale.py prints of its two-rank
side.

Minutes of a busy two-core host (docs/measurements/campaign-scale.md); `-m long_sweep` selects
it, and unit-S leaves it out (the integrator runs it: `nox -s unit-S -- -m long_sweep tests/vllm`)."""

from __future__ import annotations

import os
from typing import ClassVar

import pytest
from kvwarm_testing.campaign import Watch, ends, figures, lines
from kvwarm_testing.rank_sweeps import artifacts, rank_runs, view
from kvwarm_testing.real_kv import step_scheduler
from torch.distributed import TCPStore
from vllm.kvwarm.sweep.exchange import store as store_module

pytestmark = pytest.mark.long_sweep

POINTS = int(os.environ.get("KVWARM_LONG_SWEEP_POINTS", "10000"))
MIB = 1 << 20
FLAT = 0.9  # the last decile's time per row against the first's, each against a fresh sweep's


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


def _sweep(tmp_path, monkeypatch, points) -> tuple[list[Watch], dict, list[dict]]:
    """Both ranks' sweep of `points`, stepped in turn to the end: (their watches, the combined
    view, each rank's artifact)."""
    tmp_path.mkdir()
    with monkeypatch.context() as local:
        schedulers, out = rank_runs(tmp_path, local, points, timeout=600)
        watches = [Watch(s, s.kvwarm_sweep, s.kvwarm_run.writer) for s in schedulers]
        for _ in range(100 * len(points)):
            busy = [s for s in schedulers if s.has_requests()]
            if not busy:
                break
            for scheduler in busy:
                step_scheduler(scheduler)
            watches[0].note_memory(sum(len(w.rows) for w in watches), 2 * len(points))
        combined = view(schedulers[0])
    per_rank, _ = artifacts(out, "store")
    return watches, combined, per_rank


def test_a_ten_thousand_point_sweep_on_two_ranks_completes_flat_with_no_store_value_over_1_mib(tmp_path, monkeypatch):
    RecordingStore.sizes = []
    monkeypatch.setattr(store_module, "TCPStore", RecordingStore)
    points = _points(POINTS)
    long, combined, per_rank = _sweep(tmp_path / "long", monkeypatch, points)
    first, last = (
        _sweep(tmp_path / name, monkeypatch, taken)[0] for name, taken in zip(("first", "last"), ends(long[0]))
    )
    assert [a["status"] for a in per_rank] == ["complete", "complete"]
    assert [len(a["results"]) for a in per_rank] == [POINTS, POINTS]
    assert combined["status"] == "complete" and len(combined["results"]) == POINTS
    assert [(r["rank"], r["rows"]) for r in combined["ranks"]] == [(0, POINTS), (1, POINTS)]
    assert RecordingStore.sizes and max(RecordingStore.sizes) <= MIB
    side = figures(long, first, last)
    print("\n" + "\n".join(lines(f"{POINTS} points on 2 ranks", side)))
    print(f"{len(RecordingStore.sizes)} values set, largest {max(RecordingStore.sizes)} bytes")
    assert side["relative_ratio"] >= FLAT, f"the cost per row grew: {side['relative']}"
