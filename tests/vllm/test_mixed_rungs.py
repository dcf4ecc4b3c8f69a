"""Mixed rungs against what holds them: a points file's mixed rung beyond the KV pool refused
by name (the real rung's chains and shots counted, not a prefill point's), a rung the pool can
no longer hold at its start sent to fake KV instead of waiting, and mixed points on two
data-parallel ranks stepped in one process a step apart, each timed shot beside a shot of its
shape on the other rank (a trailing untimed one after the timed ones). Real Schedulers; the
model runner's part played by the test."""

from __future__ import annotations

import pytest
from kvwarm_testing.real_kv import in_use, make_scheduler
from test_mixed import _composition
from test_prefill import STEPS, _hashing, _run, _sweep  # noqa: F401 (_hashing: autouse)
from vllm.kvwarm.record import vocabulary as v
from vllm.kvwarm.scheduler import KvWarmScheduler
from vllm.kvwarm.sweep.limits import check_points
from vllm.kvwarm.sweep.points import DecodePoint, MixedPoint, PointsFileError, PrefillPoint


def test_a_points_files_mixed_rung_beyond_the_pool_is_refused_naming_the_point(tmp_path):
    """The real rung holds max(B_decode, B_prefill) chains as deep as the decode part's
    contexts and the steps its shadows run, beside the shot: four chains of 159 tokens (149
    admitted, the admission token, 9 steps) take 40 blocks of 16, and the shot 6 more (a
    block of each shadow's tail, two of the 32 new tokens), in a pool of 39. Checked as a
    prefill point of one request on no prefix, it needed 2."""
    scheduler = make_scheduler(tmp_path, num_blocks=40)
    deep = MixedPoint(DecodePoint(600, 4), PrefillPoint(32, 0, 1))
    args = (scheduler.vllm_config, scheduler.kv_cache_manager, "points.json")
    with pytest.raises(PointsFileError) as err:
        check_points([deep], *args, decode_steps=STEPS)
    assert str(err.value) == (
        "points.json: mixed point decode B=4 K=600 + prefill B=1 N=32 P=0: its rung's chains (4 of 159 tokens: one "
        "per request of the larger part, as deep as the rung's deepest decode context and the steps its shadows run, "
        "or its deepest prefix) and its shot need 46 KV blocks, the pool has 39 free; lower K, N or P (of this point "
        "or of its rung's deepest) or give the engine more KV cache memory"
    )
    check_points([MixedPoint(DecodePoint(200, 2), PrefillPoint(32, 0, 1))], *args, decode_steps=STEPS)


def test_a_mixed_rung_the_pool_can_no_longer_hold_goes_to_fake_kv_and_never_waits(tmp_path):
    """The point passed its check; by the rung's start served requests hold most of the pool
    (blocks taken from the real pool here): its chains would wait for blocks forever. The rung
    is trimmed to what the ranks' smallest pool holds, its point run on fake KV or skipped by
    name, and the sweep ends."""
    scheduler = make_scheduler(tmp_path, num_blocks=128, scheduler_cls=KvWarmScheduler)
    point = MixedPoint(DecodePoint(600, 4), PrefillPoint(32, 0, 1))
    check_points([point], scheduler.vllm_config, scheduler.kv_cache_manager, "points.json", decode_steps=STEPS)
    held = scheduler.kv_cache_manager.block_pool.get_new_blocks(90)  # a server's requests, in use
    sweep = _sweep([point])
    _run(scheduler, sweep, limit=400)
    assert sweep.stages == []  # no chains built: the rung went to fake KV
    (row,) = sweep.rows
    assert row.kv_seed_regime in ("fake_fallback", v.skip_regime(v.POINT_SKIP_REASON)), row.kv_seed_regime
    scheduler.kv_cache_manager.block_pool.free_blocks(held)
    assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def _shot_rounds(outputs) -> dict[int, tuple]:
    """Per round that ran a shot: its composition (the point's shape as the step ran it)."""
    return {i: _composition(o) for i, o in enumerate(outputs) if o is not None and _composition(o)[2]}


def test_mixed_points_on_two_ranks_run_a_trailing_shot_so_each_timed_one_has_a_partner(tmp_path):
    """Ranks a step apart: rank 0's engine runs one step late once the ranks met for the first
    point, so rank 1 leads it through that point, and rank 0's last timed shot would run beside
    rank 1's step after the point. One untimed shot after the timed ones (as after a prefill
    point's) keeps every timed shot beside a shot of the same shape on the other rank; the
    shadows last through it."""
    from kvwarm_testing.rank_sweeps import exchanges
    from kvwarm_testing.real_kv import step_scheduler
    from vllm.kvwarm.sweep.phase import Phase

    points = [
        MixedPoint(DecodePoint(200, 2), PrefillPoint(64, 32, 1)),
        MixedPoint(DecodePoint(90, 3), PrefillPoint(40, 0, 2)),
    ]
    schedulers = [make_scheduler(tmp_path / f"r{r}", num_blocks=192, scheduler_cls=KvWarmScheduler) for r in range(2)]
    sweeps = [_sweep(points, exchange=e) for e in exchanges(tmp_path, "files")]  # a post is seen at once
    outputs: list[list] = [[], []]
    for scheduler, sweep in zip(schedulers, sweeps):
        scheduler.kvwarm_sweep = sweep
    late = False
    for _ in range(3000):  # both ranks stepped in turn: each round one step of each (None: none)
        if not any(s.has_requests() for s in schedulers):
            break
        for rank, scheduler in enumerate(schedulers):
            if rank == 0 and not late and sweeps[0].phase is Phase.MEASURING:
                late = True  # its step this round runs a round later
                outputs[0].append(None)
                continue
            outputs[rank].append(step_scheduler(scheduler) if scheduler.has_requests() else None)
    rounds = [_shot_rounds(o) for o in outputs]
    for rank, sweep in enumerate(sweeps):
        assert sweep.done and [(r.kv_seed_regime, len(r.samples)) for r in sweep.rows] == [("real_kv", STEPS)] * 2
        # per point: the warm shot, STEPS timed ones, one trailing
        shapes = list(rounds[rank].values())
        assert shapes == [(3, [1], 2, 40, 0, 0)] * (1 + STEPS + 1) + [(2, [1], 1, 64, 32, 0)] * (1 + STEPS + 1)
        at = list(rounds[rank])
        timed = at[1 : 1 + STEPS] + at[2 + STEPS + 1 : 2 + 2 * STEPS + 1]
        other = rounds[1 - rank]
        assert [other.get(i) for i in timed] == [rounds[rank][i] for i in timed], (rank, rounds)
    assert min(rounds[1]) + 1 == min(rounds[0])  # rank 1 led the first point by a step
    for scheduler in schedulers:
        assert in_use(scheduler.kv_cache_manager.block_pool) == {}
