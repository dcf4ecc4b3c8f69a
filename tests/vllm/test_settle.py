"""Settle steps (SweepConfig.settle_steps): untimed steps of a point's own shape between its
warm step and its timed ones, stepped against a real Scheduler (vLLM's sync loop and its
batch queue) with the model runner's part played by the test. The timed steps must still
read the point's K, and only they are timed."""

from __future__ import annotations

import pytest
from kvwarm_testing.real_kv import EngineLoop, ManualClock, in_use, make_scheduler
from test_prefill import STEPS, _hashing, _run, _sweep  # noqa: F401 (_hashing: autouse)
from vllm.kvwarm.kv.injector import SHADOW_PREFIX
from vllm.kvwarm.scheduler import KvWarmAsyncScheduler, KvWarmScheduler
from vllm.kvwarm.sweep import prefill as prefill_module
from vllm.kvwarm.sweep.points import DecodePoint, MixedPoint, PrefillPoint, mixed_advance, mixed_gap_steps
from vllm.kvwarm.sweep.settings import SETTLE_ENV, SettingsError, read_settings

SETTLE = 2
PER_TOKEN_READ = 1e-6  # the played forward: this long per context token its decodes read
LOOPS = pytest.mark.parametrize(
    "cls, batch_queue", [(KvWarmScheduler, False), (KvWarmAsyncScheduler, True)], ids=["sync", "batch-queue"]
)


def _shadow_reads(output) -> int:
    """The context tokens a step's running shadows read: each one's computed tokens."""
    cached = output.scheduled_cached_reqs
    return sum(n for i, n in zip(cached.req_ids, cached.num_computed_tokens) if i.startswith(SHADOW_PREFIX))


def _shot_requests(output) -> int:
    return sum(r.req_id.startswith(prefill_module.PREFILL_PREFIX) for r in output.scheduled_new_reqs)


def _measure(tmp_path, cls, batch_queue, points, settle=SETTLE):
    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=cls)
    clock = ManualClock()
    loop = EngineLoop(scheduler, batch_queue, clock, lambda o: PER_TOKEN_READ * (_shadow_reads(o) + 1))
    sweep = _sweep(points, clock, settle_steps=settle, trailing_steps=1 if batch_queue else 0)
    outputs = _run(scheduler, sweep, loop=loop)
    assert sweep.reset_prefix_cache_ok and in_use(scheduler.kv_cache_manager.block_pool) == {}
    return sweep.rows, [o for o in outputs if o.total_num_scheduled_tokens]


@LOOPS
def test_a_decode_point_settles_untimed_and_times_its_steps_at_its_k(tmp_path, cls, batch_queue):
    rows, outputs = _measure(tmp_path, cls, batch_queue, [DecodePoint(200, 2)])
    (row,) = rows
    assert (row.total_kv_read_tokens, row.batch_size, row.kv_seed_regime, len(row.samples)) == (200, 2, "real_kv", 3)
    # after the admission step: SETTLE steps short of K, then the timed ones from K on (and
    # the batch queue's trailing one), a token a request a step
    reads = [_shadow_reads(o) for o in outputs if _shadow_reads(o)]
    trailing = 1 if batch_queue else 0
    assert reads == [200 + 2 * i for i in range(-SETTLE, STEPS + trailing)]
    if not batch_queue:  # a sync step's window is its own forward: the timed ones are those at K on
        assert row.samples == pytest.approx([PER_TOKEN_READ * (200 + 2 * i + 1) for i in range(STEPS)])


@LOOPS
def test_a_prefill_point_runs_its_settle_shots_between_the_warm_one_and_the_timed_ones(tmp_path, cls, batch_queue):
    rows, outputs = _measure(tmp_path, cls, batch_queue, [PrefillPoint(64, 32, 1)])
    (row,) = rows
    assert (row.batch_size, row.total_prefill_tokens, len(row.samples)) == (1, 64, STEPS)
    assert [_shot_requests(o) for o in outputs if _shot_requests(o)] == [1] * (1 + SETTLE + STEPS)


@LOOPS
def test_a_mixed_points_decode_part_reaches_its_k_at_the_first_timed_shot(tmp_path, cls, batch_queue):
    point = MixedPoint(DecodePoint(90, 3), PrefillPoint(40, 0, 2))
    rows, outputs = _measure(tmp_path, cls, batch_queue, [point])
    (row,) = rows
    assert row.parts["decode"] == {"batch_size": 3, "total_kv_read_tokens": 90} and len(row.samples) == STEPS
    ran = [(_shadow_reads(o), _shot_requests(o)) for o in outputs if _shadow_reads(o)]
    first = next(i for i, (_, shot) in enumerate(ran) if shot)
    # from the warm shot on, a token a request a step: each shot after the first follows a
    # step of the shadows alone (a gap, as a served chunk of a new prompt follows decodes);
    # the step before the first timed shot (the last settle shot's gap) reads the row's K
    shots = 1 + SETTLE + STEPS
    assert ran[first:] == [(90 + 3 * (i - 2 * SETTLE - 1), 2 * (i % 2 == 0)) for i in range(2 * shots - 1)]
    assert ran[first + 2 * SETTLE + 1] == (90, 0)


def test_a_gap_step_precedes_new_requests_shots_on_one_rank_only():
    """A continuation's lead step runs where the gap would; ranks may start a point a step
    apart, so over several a gap would put a timed shot beside another rank's decode step."""
    new = MixedPoint(DecodePoint(90, 3), PrefillPoint(40, 0, 2))
    continuation = MixedPoint(DecodePoint(90, 3), PrefillPoint(40, 32, 1, continuation=True))
    assert [mixed_gap_steps(new), mixed_gap_steps(new, ranks=2), mixed_gap_steps(continuation)] == [1, 0, 0]
    # the tokens computed before the first timed shot: the settle shots', and a gap after
    # the warm shot and after each settle shot
    assert [mixed_advance(new, SETTLE), mixed_advance(new, SETTLE, ranks=2)] == [2 * SETTLE + 1, SETTLE]
    assert mixed_advance(continuation, SETTLE) == SETTLE


def test_settle_steps_are_read_from_the_environment_and_checked():
    assert read_settings({}).settle_steps == 0
    assert read_settings({SETTLE_ENV: "12"}).point_steps == 15
    with pytest.raises(SettingsError, match=f"{SETTLE_ENV}='-1' is out of range"):
        read_settings({SETTLE_ENV: "-1"})
