"""Exact state's parts on the real classes: a shadow lent by a catch-up chain exactly ctx
deep, the catch-up's block counts, the prefix lookup they rest on, and the prefill cap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvwarm_testing.real_kv import (
    in_use,
    make_chain,
    make_kv_cache_manager,
    make_request,
    make_scheduler,
    step_scheduler,
)
from vllm.kvwarm.kv import catchup as catchup_module
from vllm.kvwarm.kv.layout import group_layouts
from vllm.kvwarm.kv.shadows import ShadowRegistrationError, register_shadow, release_fork_retentions
from vllm.kvwarm.record.vocabulary import CHAIN_TOO_SHALLOW
from vllm.kvwarm.scheduler import KvWarmScheduler


def test_a_catch_up_exactly_ctx_deep_lends_its_blocks_and_the_tail_past_it_is_fresh():
    kvm = make_kv_cache_manager([16])
    catchup = make_chain(kvm, "catchup", 45)  # 3 blocks: 2 full, 1 holding positions 32..44
    baseline = in_use(kvm.block_pool)
    with pytest.raises(ShadowRegistrationError) as err:  # a plain chain must cover the tail
        register_shadow(kvm, make_request("plain", 46), catchup, ctx=45, steady_steps=3)
    assert err.value.reason == CHAIN_TOO_SHALLOW
    assert in_use(kvm.block_pool) == baseline

    shadow = make_request("shadow", 46)
    registration = register_shadow(kvm, shadow, catchup, ctx=45, steady_steps=3, room_past_chain=True)
    chain_ids = [b.block_id for b in kvm.coordinator.single_type_managers[0].req_to_blocks["catchup"]]
    table = registration.groups[0]
    assert table.num_shared == 2
    assert [source for source, _ in table.forks] == [chain_ids[2]]  # the block holding 32..44, copied
    assert len(table.zero_filled) == 1  # position 48 on: the shadow's own
    copies = release_fork_retentions(kvm)
    assert len(copies) == 1
    kvm.free(shadow)
    kvm.free(catchup)
    assert not [b for b in kvm.block_pool.blocks if b.ref_cnt and not b.is_null]


def test_a_catch_up_that_has_not_computed_its_context_is_too_shallow():
    kvm = make_kv_cache_manager([16])
    catchup = make_chain(kvm, "catchup", 45)
    catchup.num_computed_tokens = 40
    with pytest.raises(ShadowRegistrationError, match="40 computed token") as err:
        register_shadow(kvm, make_request("shadow", 46), catchup, ctx=45, steady_steps=3, room_past_chain=True)
    assert err.value.reason == CHAIN_TOO_SHALLOW


def test_the_prefix_lookup_finds_what_a_chain_cached_and_a_catch_up_counts_the_rest(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # the same hash seed for both requests' blocks
    kvm = make_kv_cache_manager([16])
    chain = make_chain(kvm, "chain", 64)
    catchup = make_request("catchup", 40, hash_block_size=16)  # the same tokens, 40 of them
    hit = catchup_module.cached_tokens(kvm, catchup)
    assert hit == 32  # two full blocks; the third is not full in a 40-token prompt
    layouts = group_layouts(kvm)
    assert catchup_module.catchup_blocks(layouts, 40, hit) == 1  # the block holding 32..39
    assert catchup_module.catchup_blocks(layouts, 40, 0) == 3
    kvm.free(chain)


def test_the_prefill_cap_is_put_back_and_never_raises_a_smaller_setting():
    """On stand-ins of a scheduler holding its config alone (the setting's arithmetic; the real
    scheduler's cap: the test below), and of a config of a build without the setting."""
    config = SimpleNamespace(long_prefill_token_threshold=0)  # a scheduler config's stand-in
    scheduler_stand_in = SimpleNamespace(scheduler_config=config)
    cap = catchup_module.PrefillChunkCap(scheduler_stand_in, 256)
    cap.apply()
    assert config.long_prefill_token_threshold == 256
    cap.apply()  # twice is once
    cap.restore()
    assert config.long_prefill_token_threshold == 0
    config.long_prefill_token_threshold = 100
    cap.apply()
    assert config.long_prefill_token_threshold == 100
    cap.restore()
    assert config.long_prefill_token_threshold == 100
    bare_config_stand_in = SimpleNamespace()  # a build without the setting
    catchup_module.PrefillChunkCap(SimpleNamespace(scheduler_config=bare_config_stand_in), 256).apply()
    assert not vars(bare_config_stand_in)


def test_a_capped_lone_prefill_steps_one_state_block_with_every_boundary_retained(tmp_path):
    """On a real kvwarm scheduler over a hybrid layout, a lone request prefills one state
    block per step while the cap is applied, whether the build's scheduler applies the
    long-prefill threshold to a lone request or lifts it; a coordinator that retains
    boundary states sparsely retains every one meanwhile; restore() puts both back."""
    scheduler = make_scheduler(
        tmp_path, num_blocks=128, block_size=32, state_block_size=32, scheduler_cls=KvWarmScheduler
    )
    coordinator = scheduler.kv_cache_manager.coordinator
    retention = getattr(coordinator, "retention_interval", "absent")
    budget, threshold = scheduler.max_num_scheduled_tokens, scheduler.scheduler_config.long_prefill_token_threshold
    cap = catchup_module.PrefillChunkCap(scheduler, 32)
    cap.apply()
    if retention != "absent":
        assert coordinator.retention_interval is None
    scheduler.add_request(make_request("chain", 224))  # seven state blocks
    assert [step_scheduler(scheduler).num_scheduled_tokens["chain"] for _ in range(3)] == [32, 32, 32]
    cap.restore()
    assert getattr(coordinator, "retention_interval", "absent") == retention
    assert scheduler.max_num_scheduled_tokens == budget
    assert scheduler.scheduler_config.long_prefill_token_threshold == threshold
    # Uncapped again: the rest in one step, or (where the scheduler ends a step at the prompt's
    # last state boundary, to keep that state) all of it up to that boundary.
    assert step_scheduler(scheduler).num_scheduled_tokens["chain"] > 32


def _hybrid_scheduler(tmp_path):
    return make_scheduler(tmp_path, num_blocks=128, block_size=32, state_block_size=32, scheduler_cls=KvWarmScheduler)


def test_the_cap_holds_for_several_chains_where_the_scheduler_floors_its_threshold(tmp_path):
    """A scheduler that floors the long-prefill threshold at a share of its budget (where it
    has that setting, turned on here) would prefill two chains 128 tokens a step; the cap
    turns the floor off while applied and puts it back."""
    scheduler = _hybrid_scheduler(tmp_path)
    floors = hasattr(scheduler, catchup_module.PrefillChunkCap.ADAPTIVE)
    if floors:
        scheduler.adaptive_long_prefill_threshold = True
    cap = catchup_module.PrefillChunkCap(scheduler, 32)
    cap.apply()
    for name in ("a", "b"):
        scheduler.add_request(make_request(name, 224, token=3 if name == "a" else 4))
    steps = [step_scheduler(scheduler).num_scheduled_tokens for _ in range(2)]
    assert steps == [{"a": 32, "b": 32}] * 2
    cap.restore()
    assert getattr(scheduler, catchup_module.PrefillChunkCap.ADAPTIVE, False) is floors


def test_with_chunked_prefill_off_the_cap_never_stalls_a_lone_chain(tmp_path):
    """With chunked prefill off a prompt over the step's budget is never scheduled, and some
    releases ignore the threshold there: the cap leaves a lone chain's budget alone, so its
    prefill goes on (in capped chunks where the release still caps it, whole where not)."""
    scheduler = _hybrid_scheduler(tmp_path)
    scheduler.scheduler_config.enable_chunked_prefill = False
    cap = catchup_module.PrefillChunkCap(scheduler, 32)
    cap.apply()
    scheduler.add_request(make_request("chain", 224))
    done = 0
    for _ in range(7):
        done += step_scheduler(scheduler).num_scheduled_tokens.get("chain", 0)
        if done >= 224:
            break
    assert done >= 224
    cap.restore()
    assert scheduler.kvwarm_prefill_cap is None
