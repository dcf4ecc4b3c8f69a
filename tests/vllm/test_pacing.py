"""The one pace of the sweep's periodic writes (sweep.pacing), which the artifact writer (with a
floor) and rank 0's combined view (without) keep: a write waits until the last one is paid for
at the share asked, and one that cost no more than the floor never holds the next back. On a
clock only the test moves, with figures worked out by hand (a share of a half: a write of s
seconds is paid for s seconds after it ends)."""

from __future__ import annotations

from kvwarm_testing.real_kv import ManualClock
from vllm.kvwarm.sweep.pacing import Pacing

HALF = 0.5


def _write(pacing: Pacing, clock: ManualClock, seconds: float) -> None:
    began = clock()
    clock.advance(seconds)
    pacing.wrote(began)


def test_a_write_waits_until_the_last_one_takes_no_more_than_its_share():
    clock = ManualClock()
    pacing = Pacing(HALF, clock=clock)
    assert pacing.due()  # nothing written yet
    _write(pacing, clock, 2.0)  # 2 s: half of 4 s, so 2 s more must pass after it
    assert not pacing.due()
    clock.advance(1.5)
    assert not pacing.due()
    clock.advance(0.5)
    assert pacing.due()
    _write(pacing, clock, 1.0)  # a cheaper write: 1 s after it
    clock.advance(0.5)
    assert not pacing.due()
    clock.advance(0.5)
    assert pacing.due()


def test_a_write_within_the_floor_never_holds_the_next_back_and_none_does_without_one():
    clock = ManualClock()
    floored, bare = Pacing(HALF, floor=0.5, clock=clock), Pacing(HALF, clock=clock)
    for pacing in (floored, bare):
        _write(pacing, clock, 0.5)
    assert floored.due() and not bare.due()  # 0.5 s is the floor itself: not over it
    _write(floored, clock, 0.75)
    assert not floored.due()
    clock.advance(0.75)
    assert floored.due()
