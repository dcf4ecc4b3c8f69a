"""Admitting a point's shadows through the scheduler adapter, on a real Scheduler and a
real AsyncScheduler (the model runner's part is played by the test: one sampled token per
request that finished its prompt)."""

from __future__ import annotations

import pytest
from kvwarm_testing.real_kv import in_use, make_request, make_scheduler, park, step_scheduler
from vllm.kvwarm.kv.injector import SHADOW_PREFIX, Admission
from vllm.kvwarm.scheduler import KvWarmAsyncScheduler, KvWarmScheduler


def _step(scheduler):
    return step_scheduler(scheduler, token=5)


def _parked_chains(scheduler, lengths):
    chains = [make_request(f"chain{i}", n, token=11 + i) for i, n in enumerate(lengths)]
    for chain in chains:
        chain.max_tokens = chain.sampling_params.max_tokens = 10_000
    park(scheduler, chains, token=5)
    return chains


@pytest.fixture(params=[KvWarmScheduler, KvWarmAsyncScheduler], ids=["sync", "async"])
def scheduler(request, tmp_path):
    return make_scheduler(tmp_path, num_blocks=128, scheduler_cls=request.param)


@pytest.mark.parametrize("fork", [True, False])
def test_a_point_is_admitted_one_token_short_then_decoded_by_the_stock_loop(scheduler, fork):
    kvm = scheduler.kv_cache_manager
    manager = kvm.coordinator.single_type_managers[0]
    chains = _parked_chains(scheduler, [100, 150])
    baseline = in_use(kvm.block_pool)
    assert not scheduler.has_requests() or scheduler.has_finished_requests()

    point = scheduler.kvwarm_injector.queue(Admission(chains, contexts=[60, 99], steady_steps=3, fork=fork))
    assert scheduler.has_requests()  # a queued point makes the engine step
    admission = _step(scheduler)

    assert point.failure is None and len(point.shadows) == 2
    new = {r.req_id: r for r in admission.scheduled_new_reqs}
    for shadow, chain, ctx in zip(point.shadows, chains, [60, 99]):
        sid = shadow.request_id
        # keys of its own on an attention layout: hashed past its prefix, like any request
        assert sid.startswith(SHADOW_PREFIX) and not shadow.borrowed_kv
        assert new[sid].num_computed_tokens == ctx and admission.num_scheduled_tokens[sid] == 1
        assert new[sid].block_ids == kvm.get_block_ids(sid)
        assert shadow.prompt_token_ids == chain.all_token_ids[: ctx + 1]
        assert manager.req_to_blocks[sid][: ctx // 16] == manager.req_to_blocks[chain.request_id][: ctx // 16]
    copies = admission.kv_cache_block_copies or []
    assert (len(copies) == 2) == fork  # one partial tail block per shadow (60 % 16, 99 % 16)

    tails = [manager.req_to_blocks[s.request_id][ctx // 16] for s, ctx in zip(point.shadows, [60, 99])]
    chain_keys = {b.block_hash for c in chains for b in manager.req_to_blocks[c.request_id]}
    steady = [_step(scheduler) for _ in range(3)]
    # the ctx-60 shadow fills its tail block (48..63) itself and caches it, as a natural
    # request would; the ctx-99 one does not reach its block's end
    assert tails[0].block_hash is not None and tails[0].block_hash not in chain_keys
    assert tails[1].block_hash is None
    for output in steady:
        assert sorted(output.num_scheduled_tokens) == sorted(s.request_id for s in point.shadows)
        assert set(output.num_scheduled_tokens.values()) == {1}
        assert not output.scheduled_new_reqs and not output.kv_cache_block_copies
    for shadow in point.shadows:  # admission token + 3 steady tokens: finished by length
        assert shadow.is_finished() and len(shadow.output_token_ids) == 4
    _step(scheduler)  # carries the finished ids to the worker
    assert in_use(kvm.block_pool) == baseline
    _finish(scheduler, chains)


def _finish(scheduler, chains):
    from vllm.v1.request import RequestStatus

    scheduler.finish_requests([c.request_id for c in chains], RequestStatus.FINISHED_ABORTED)
    _step(scheduler)
    pool = scheduler.kv_cache_manager.block_pool
    assert in_use(pool) == {} and pool.reset_prefix_cache()


def test_a_point_that_cannot_be_registered_leaves_nothing_behind(scheduler):
    kvm = scheduler.kv_cache_manager
    chains = _parked_chains(scheduler, [100, 40])
    baseline = in_use(kvm.block_pool)
    # The second chain is too shallow for ctx 60: the first shadow is unwound with it.
    point = scheduler.kvwarm_injector.queue(Admission(chains, contexts=[60, 60], steady_steps=3))
    output = _step(scheduler)
    assert "too shallow" in point.failure and point.shadows == []
    assert not output.scheduled_new_reqs and not output.kv_cache_block_copies
    assert not [r for r in scheduler.requests if r.startswith(SHADOW_PREFIX)]
    assert in_use(kvm.block_pool) == baseline
    _finish(scheduler, chains)


def test_a_point_beyond_the_free_pool_is_refused_before_any_registration(tmp_path):
    scheduler = make_scheduler(tmp_path, num_blocks=20, scheduler_cls=KvWarmScheduler)
    kvm = scheduler.kv_cache_manager
    chains = _parked_chains(scheduler, [100, 100])  # 14 of 19 usable blocks
    baseline = in_use(kvm.block_pool)
    point = scheduler.kvwarm_injector.queue(Admission(chains * 3, contexts=[90] * 6, steady_steps=3))
    output = _step(scheduler)
    assert point.failure.startswith("pool_exhausted") and not output.scheduled_new_reqs
    assert in_use(kvm.block_pool) == baseline
    _finish(scheduler, chains)


def test_with_nothing_queued_the_adapter_schedules_like_stock(tmp_path):
    from vllm.v1.core.sched.scheduler import Scheduler

    runs = []
    for cls in (Scheduler, KvWarmScheduler):
        scheduler = make_scheduler(tmp_path / cls.__name__, num_blocks=128, scheduler_cls=cls)
        for i in range(4):
            request = make_request(f"r{i}", 30 + 20 * i)
            request.max_tokens = request.sampling_params.max_tokens = 6
            scheduler.add_request(request)
        runs.append([sorted(_step(scheduler).num_scheduled_tokens.items()) for _ in range(10)])
    assert runs[0] == runs[1]


def test_a_point_needs_one_chain_per_context(tmp_path):
    scheduler = make_scheduler(tmp_path, scheduler_cls=KvWarmScheduler)
    with pytest.raises(ValueError, match="one chain per context, got 1 chain.* for 2 context"):
        scheduler.kvwarm_injector.queue(Admission([object()], contexts=[10, 20], steady_steps=1))
    assert not scheduler.kvwarm_injector.has_pending()
