"""Admitting a point's shadows through the scheduler adapter, on a real Scheduler and a
real AsyncScheduler (the model runner's part is played by the test: one sampled token per
request that finished its prompt)."""

from __future__ import annotations

import pickle

import pytest
from kvwarm_testing.real_kv import (
    in_use,
    make_request,
    make_scheduler,
    park,
    step_scheduler,
    v2_runner_request_state,
)
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


def _admitted_on_the_v2_runner(tmp_path, scheduler_cls):
    """A point of two shadows admitted by a scheduler whose engine runs the V2 model runner
    (a release that still has the V1 runner is told so; the others have only the V2 one),
    with its new requests as a worker process receives them."""
    scheduler = make_scheduler(tmp_path, num_blocks=128, scheduler_cls=scheduler_cls)
    if hasattr(scheduler, "use_v2_model_runner"):
        scheduler.use_v2_model_runner = True
    chains = _parked_chains(scheduler, [100, 150])
    point = scheduler.kvwarm_injector.queue(Admission(chains, contexts=[60, 99], steady_steps=3, fork=False))
    sent = []  # the step's output as a worker process receives it: pickled before the step runs
    step_scheduler(scheduler, token=5, sent=lambda output: sent.append(pickle.loads(pickle.dumps(output))))
    assert point.failure is None and len(point.shadows) == 2
    return scheduler, chains, point.shadows, {r.req_id: r for r in sent[0].scheduled_new_reqs}


@pytest.mark.parametrize("scheduler_cls", [KvWarmScheduler, KvWarmAsyncScheduler], ids=["sync", "async"])
def test_a_shadow_reaches_the_v2_runner_with_its_whole_token_list(tmp_path, scheduler_cls):
    scheduler, chains, shadows, new = _admitted_on_the_v2_runner(tmp_path, scheduler_cls)
    for shadow in shadows:
        tokens = new[shadow.request_id].prefill_token_ids
        assert tokens is not None and list(tokens) == shadow.prompt_token_ids
    _finish(scheduler, [*chains, *shadows])


def test_the_v2_runner_s_request_state_takes_a_shadow_as_it_takes_a_new_request(tmp_path):
    """The V2 runner's own request path on its real class: add_requests hands each new
    request's prompt length, prefill_token_ids and computed count to its request state."""
    scheduler, chains, shadows, new = _admitted_on_the_v2_runner(tmp_path, KvWarmScheduler)
    states = v2_runner_request_state(scheduler)
    if states is None:
        pytest.skip("this release's V2 runner keeps request state in GPU buffers only (no CPU runner on V2)")
    for shadow in shadows:  # as the runner's add_requests calls it
        data = new[shadow.request_id]
        states.add_request(
            req_id=data.req_id,
            prompt_len=data.prompt_len,
            all_token_ids=data.prefill_token_ids,
            num_computed_tokens=data.num_computed_tokens,
            max_tokens=data.sampling_params.max_tokens,
        )
    for shadow in shadows:
        index, n = states.req_id_to_index[shadow.request_id], len(shadow.prompt_token_ids)
        assert states.all_token_ids[index, :n].tolist() == shadow.prompt_token_ids
        assert states.prefill_len_np[index] == n and states.num_computed_tokens_np[index] == n - 1
    _finish(scheduler, [*chains, *shadows])


# The scheduler queues of waiting requests vLLM releases keep (docs/hooks.md, per release).
WAITING_QUEUES = ("waiting", "skipped_waiting", "kv_holding_waiting", "async_kv_waiting")


def test_a_measured_schedule_holds_the_others_in_every_waiting_queue_the_release_has(tmp_path):
    scheduler = make_scheduler(tmp_path, num_blocks=128, scheduler_cls=KvWarmScheduler)
    present = [name for name in WAITING_QUEUES if hasattr(scheduler, name)]
    assert set(scheduler.kvwarm_queues) == set(present)
    others = {name: [make_request(f"{name}-{i}", 20) for i in range(2)] for name in present}
    for name, requests in others.items():
        for request in requests:
            scheduler.requests[request.request_id] = request
            getattr(scheduler, name).add_request(request)
    mine = make_request("mine", 20)
    scheduler.add_request(mine)
    output, _, _ = scheduler._schedule_only({"mine"}, None)
    assert list(output.num_scheduled_tokens) == ["mine"]
    for name, requests in others.items():
        assert [r.request_id for r in getattr(scheduler, name)] == [r.request_id for r in requests]
    output, _, _ = scheduler._schedule_only(None, None)  # between points: every one runs
    assert sorted(output.num_scheduled_tokens) == sorted(r.request_id for rs in others.values() for r in rs)


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
