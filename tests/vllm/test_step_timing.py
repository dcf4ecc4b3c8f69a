"""What the sweep times and how it splits a step: the phases of every timed step, a decode
window being one served step in either engine loop (one step at a time, or vLLM's batch queue
under async scheduling), the sweep's own work kept apart from vLLM's, the point's request
filter costing nothing when no other request is there, and Python's collector held out of the
timed steps. All on a real Scheduler (sync and async) with the model runner's part played by
the test."""

from __future__ import annotations

import gc
import itertools

import pytest
from kvwarm_testing.real_kv import EngineLoop, ManualClock, in_use, make_request, make_scheduler
from vllm.kvwarm import scheduler as adapter
from vllm.kvwarm.kv.injector import SHADOW_PREFIX
from vllm.kvwarm.record import vocabulary as v
from vllm.kvwarm.scheduler import KvWarmAsyncScheduler, KvWarmScheduler
from vllm.kvwarm.sweep.controller import Phase, Sweep
from vllm.kvwarm.sweep.plan import SweepConfig
from vllm.kvwarm.sweep.points import DecodePoint
from vllm.kvwarm.sweep.provenance import trailing_steps
from vllm.kvwarm.sweep.timing import StepTimer


@pytest.fixture(autouse=True)
def _hashing():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def _tokens(i: int, depth: int) -> list[int]:
    return [(7 * i + 3 * t) % 200 + 2 for t in range(depth)]


def _sweep(points, clock, **config) -> Sweep:
    return Sweep(
        points, _tokens, SweepConfig(steady_steps=3, max_model_len=1024, **config), clock=clock, progress=lambda _: None
    )


def _run(scheduler, sweep, limit: int = 400, each_step=lambda: None, loop: EngineLoop | None = None) -> None:
    """Step to the end, one step at a time or through `loop`."""
    scheduler.kvwarm_sweep = sweep
    loop = loop or EngineLoop(scheduler, batch_queue=False)
    for _ in range(limit):
        if not loop.busy():
            break
        each_step()
        loop.step()
    assert sweep.done and sweep.reset_prefix_cache_ok
    assert in_use(scheduler.kv_cache_manager.block_pool) == {}


LOOPS = [(KvWarmScheduler, False), (KvWarmAsyncScheduler, True)]
LOOP_IDS = ["sync", "async-batch-queue"]


@pytest.mark.parametrize("cls, batch_queue", LOOPS, ids=LOOP_IDS)
def test_every_timed_step_is_split_into_its_phases(tmp_path, cls, batch_queue):
    """A clock that ticks once per reading: in a timed step the adapter reads it at schedule()'s
    entry, around vLLM's own schedule(), at its exit, around update_from_output and after the
    sweep's update hook; the sweep reads it once in that hook. So each step is 8 ticks: 1 of
    vLLM's schedule(), 1 of forward, 1 of update, 4 of ours and 1 of the loop between steps
    (the same count in either loop: under the batch queue the schedule() is the next step's)."""
    scheduler = make_scheduler(tmp_path, num_blocks=128, scheduler_cls=cls)
    config = {"trailing_steps": trailing_steps(scheduler.vllm_config)}
    sweep = _sweep([DecodePoint(200, 2), DecodePoint(90, 1)], clock=itertools.count().__next__, **config)
    _run(scheduler, sweep, loop=EngineLoop(scheduler, batch_queue))
    for row in sweep.rows:
        assert row.samples == [8, 8, 8]
        assert row.phases == {"schedule": 1, "forward": 1, "update": 1, "sweep": 4, "other": 1}


FORWARD_PER_REQUEST = 1e-3  # the played model runner's forward: this long per request scheduled


@pytest.mark.parametrize("cls, batch_queue", LOOPS, ids=LOOP_IDS)
def test_a_timed_decode_window_is_one_served_step_of_the_points_requests_in_either_loop(tmp_path, cls, batch_queue):
    """Only the played runner's forward takes time (1 ms per request scheduled, when the step
    is submitted), so a served step of B decode requests is B ms in either loop: one step at a
    time the window holds its own step's forward, under the batch queue the next step's. Every
    timed window must be that, the last one included; no step may run a user's request (one
    arrives while each point is measured) or another point's beside the point's, and the
    point's requests run their admission step, the timed steps and, under the batch queue,
    one untimed step after them (so that the last timed window holds a step of the point's
    B too), never more."""
    scheduler = make_scheduler(tmp_path, num_blocks=160, scheduler_cls=cls)
    clock = ManualClock()
    loop = EngineLoop(
        scheduler, batch_queue, clock, lambda output: FORWARD_PER_REQUEST * len(output.num_scheduled_tokens)
    )
    trailing = trailing_steps(scheduler.vllm_config)
    assert trailing == int(batch_queue)
    sweep = _sweep([DecodePoint(200, 2), DecodePoint(120, 2), DecodePoint(90, 3)], clock=clock, trailing_steps=trailing)
    users = []

    def a_user_arrives_while_measuring():
        if sweep.phase is Phase.MEASURING and len(users) < len(sweep.rows) + 1:
            users.append(f"user{len(users)}")
            scheduler.add_request(make_request(users[-1], 20))

    _run(scheduler, sweep, each_step=a_user_arrives_while_measuring, loop=loop)
    assert [r.kv_seed_regime for r in sweep.rows] == [v.REAL_KV] * 3 and len(users) == 3
    for row in sweep.rows:
        step = FORWARD_PER_REQUEST * row.batch_size
        assert row.samples == pytest.approx([step] * 3), row
        assert row.phases["forward"] == pytest.approx(step) and row.median_seconds == pytest.approx(step)
    shadow_steps: dict[str, int] = {}
    for output in loop.outputs:
        scheduled = set(output.num_scheduled_tokens)
        shadows = {r for r in scheduled if r.startswith(SHADOW_PREFIX)}
        assert not shadows or shadows == scheduled, f"a step ran {sorted(scheduled)}"
        for r in shadows:
            shadow_steps[r] = shadow_steps.get(r, 0) + 1
    assert len(shadow_steps) == 7 and set(shadow_steps.values()) == {1 + 3 + trailing}
    assert all(u not in scheduler.requests for u in users)  # served between the points


def test_the_timer_splits_a_window_between_two_update_ends():
    timer = StepTimer(clock=lambda: 0.0)
    assert timer.update_done(None, 10.0) is None  # no start yet (nor a schedule() seen)
    timer.sweep_work(0.5)  # our update hook, after the first update
    step = timer.schedule_done(enter=11.0, stock_start=11.25, stock_end=12.0, leave=12.5)
    timer.update_started(14.0)
    window = timer.update_done(step, 14.5)
    assert window.wall == 4.5
    assert window.phases == {"schedule": 0.75, "forward": 1.5, "update": 0.5, "sweep": 1.25, "other": 0.5}
    # one step at a time, the step's own span is the window less the loop before its schedule()
    assert window.span.wall == 3.5
    assert window.span.phases == {"schedule": 0.75, "forward": 1.5, "update": 0.5, "sweep": 0.75, "other": 0.0}


def test_under_the_batch_queue_a_steps_span_starts_at_its_own_schedule_not_the_next():
    """vLLM's batch queue: schedule n+1 runs before update n. The window update n closes holds
    schedule n+1; step n's span runs from its own schedule() (in the window before) to its update."""
    timer = StepTimer(clock=lambda: 0.0)
    n = timer.schedule_done(enter=0.0, stock_start=0.5, stock_end=1.5, leave=2.0)
    timer.update_started(3.0)
    timer.update_done(None, 3.5)  # the step before n (its schedule() not seen): the open window starts here
    timer.schedule_done(enter=4.0, stock_start=4.0, stock_end=4.5, leave=5.0)  # n + 1's
    timer.update_started(9.0)
    window = timer.update_done(n, 10.0)
    assert window.wall == 6.5
    assert window.phases == {"schedule": 0.5, "forward": 4.0, "update": 1.0, "sweep": 0.5, "other": 0.5}
    assert window.span.wall == 10.0
    assert window.span.phases == {"schedule": 1.0, "forward": 7.0, "update": 1.0, "sweep": 1.0, "other": 0.0}


def test_a_point_with_nothing_else_to_hold_schedules_without_moving_a_queue(tmp_path, monkeypatch):
    made = []
    create = adapter.create_request_queue
    monkeypatch.setattr(adapter, "create_request_queue", lambda policy: made.append(policy) or create(policy))
    scheduler = make_scheduler(tmp_path, num_blocks=128, scheduler_cls=KvWarmScheduler)
    _run(scheduler, _sweep([DecodePoint(120, 2)], clock=itertools.count().__next__))
    assert made == []
    # with a request of someone else's waiting, the filter does move the queues
    scheduler = make_scheduler(tmp_path, num_blocks=128, scheduler_cls=KvWarmScheduler)
    sweep = _sweep([DecodePoint(120, 2)], clock=itertools.count().__next__)
    scheduler.kvwarm_sweep = sweep

    def a_user_arrives_while_measuring():
        if sweep.phase is Phase.MEASURING and "user" not in scheduler.requests and not made:
            scheduler.add_request(make_request("user", 20))

    _run(scheduler, sweep, each_step=a_user_arrives_while_measuring)
    assert made and [r.kv_seed_regime for r in sweep.rows] == ["real_kv"]


def _collections_while_timed(tmp_path, gc_hold: bool) -> tuple[int, int, Sweep]:
    """Collections that start while a point is admitted and timed, and in all, with the
    collector made to run at every allocation (threshold 1) during the sweep."""
    scheduler = make_scheduler(tmp_path, num_blocks=128, scheduler_cls=KvWarmScheduler)
    sweep = _sweep([DecodePoint(200, 2), DecodePoint(120, 2)], clock=itertools.count().__next__, gc_hold=gc_hold)
    timed, total = [], []

    def on_gc(phase, info):
        if phase == "start":
            total.append(1)
            if sweep.phase is Phase.MEASURING:
                timed.append(info["generation"])

    threshold = gc.get_threshold()
    gc.callbacks.append(on_gc)
    gc.set_threshold(1)
    try:
        _run(scheduler, sweep)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(on_gc)
    return len(timed), len(total), sweep


def test_no_collection_runs_inside_a_timed_step(tmp_path):
    timed, total, sweep = _collections_while_timed(tmp_path, gc_hold=True)
    assert timed == 0 and total > 0  # the collector did run: between points
    record = sweep.gc_record()
    assert record["policy"] == "held" and record["collections_between_points"] == 2
    assert gc.isenabled() and gc.get_freeze_count() == 0  # the process's policy is back
    assert (record["engine_froze_heap"], record["heap_at_end"]) == (False, "unfrozen")
    # no engine here, so no executor: the workers are recorded as not reached, and why
    assert record["workers"]["policy"] == "unreached" and "no executor" in record["workers"]["detail"]


def test_with_the_hold_off_collections_do_land_in_timed_steps(tmp_path):
    """The check above can fail: without the hold, this sweep's timed steps see collections."""
    timed, _, sweep = _collections_while_timed(tmp_path, gc_hold=False)
    assert timed > 0 and sweep.gc_record() == {
        "policy": "engine",
        "collections_between_points": 0,
        "collection_seconds": 0.0,
        "engine_froze_heap": None,
        "heap_at_end": None,
    }


@pytest.mark.parametrize("real", [True, False], ids=["chains", "fake-kv"])
def test_what_exists_before_the_timed_points_is_frozen_while_they_run(tmp_path, real):
    """With chains, what exists once they are built; without (fake KV), what exists before the
    first point: so the collection between points scans only what the points made."""
    scheduler = make_scheduler(tmp_path, num_blocks=128, scheduler_cls=KvWarmScheduler)
    sweep = _sweep([DecodePoint(200, 2), DecodePoint(120, 2)], clock=itertools.count().__next__, real=real)
    frozen_while_timed = []

    def note():
        if sweep.phase is Phase.MEASURING:
            frozen_while_timed.append(gc.get_freeze_count())

    _run(scheduler, sweep, each_step=note)
    assert frozen_while_timed and min(frozen_while_timed) > 0
    assert [r.kv_seed_regime for r in sweep.rows] == [v.REAL_KV if real else v.FAKE_FALLBACK] * 2
    assert gc.get_freeze_count() == 0  # unfrozen at the end: the engine had frozen nothing


class _Cycle:
    """A reference cycle (only the collector frees it), with a weak reference to tell."""

    def __init__(self):
        self.me = self


def _garbage_while(tmp_path, make_when, drop_when, engine_enabled: bool = True):
    """A sweep on an engine that froze its heap at start, as vLLM's EngineCore does
    (freeze_gc_heap: collect, then gc.freeze). A cycle is made in the first step of phase
    `make_when` and its last reference dropped in the first step of `drop_when`; returns a
    weak reference to it, whether it was alive as each phase began, and the sweep."""
    import weakref

    scheduler = make_scheduler(tmp_path, num_blocks=128, scheduler_cls=KvWarmScheduler)
    sweep = _sweep([DecodePoint(200, 2), DecodePoint(120, 2)], clock=itertools.count().__next__)
    held, seen = {}, {}

    def each_step():
        if sweep.phase is make_when and "ref" not in held:
            cycle = _Cycle()
            held["cycle"], held["ref"] = cycle, weakref.ref(cycle)
        if sweep.phase is drop_when and "ref" in held:
            held.pop("cycle", None)
        seen.setdefault(sweep.phase, "ref" in held and held["ref"]() is not None)

    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    if not engine_enabled:
        gc.disable()
    try:
        _run(scheduler, sweep, each_step=each_step)
        return held["ref"], seen, sweep, gc.get_freeze_count(), gc.isenabled()
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def test_on_an_engine_that_froze_its_heap_the_sweeps_freezes_are_undone_and_its_heap_frozen_again(tmp_path):
    """A cycle alive when the chains were built (so frozen with them) and dropped while the
    points run is freed at the end: the sweep's freezes are undone, then the engine's frozen
    heap is put back (it stayed frozen for good: the engine had frozen objects of its own)."""
    ref, _, sweep, frozen_after, enabled_after = _garbage_while(tmp_path, Phase.BUILDING, Phase.MEASURING)
    gc.collect()
    assert ref() is None
    assert frozen_after > 0 and enabled_after  # the engine's policy: a frozen heap, collection on
    record = sweep.gc_record()
    assert (record["engine_froze_heap"], record["heap_at_end"]) == (True, "refrozen")


def test_garbage_alive_when_the_chains_are_built_is_collected_before_the_freeze(tmp_path):
    """As vLLM's freeze_gc_heap: collect, then freeze. A cycle dropped while the chains
    prefill (garbage, uncollected: this engine runs with collection off) is freed by the
    freeze after the build, not frozen with the chains."""
    ref, seen, _, _, enabled_after = _garbage_while(tmp_path, Phase.NEXT_RUNG, Phase.BUILDING, engine_enabled=False)
    assert seen[Phase.BUILDING]  # still there while the chains prefill
    assert not seen[Phase.MEASURING] and ref() is None  # freed at the freeze
    assert not enabled_after  # collection left off, as the engine had it
