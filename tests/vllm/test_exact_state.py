"""Exact state's parts on the real classes: a shadow lent by a catch-up chain exactly ctx
deep, the catch-up's block counts, the prefix lookup they rest on, and the prefill cap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvwarm_testing.real_kv import in_use, make_chain, make_kv_cache_manager, make_request
from vllm.kvwarm.kv import catchup as catchup_module
from vllm.kvwarm.kv.layout import group_layouts
from vllm.kvwarm.kv.shadows import ShadowRegistrationError, register_shadow, release_fork_retentions
from vllm.kvwarm.record.vocabulary import CHAIN_TOO_SHALLOW


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
    config = SimpleNamespace(long_prefill_token_threshold=0)
    cap = catchup_module.PrefillChunkCap(config, 256)
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
    bare = SimpleNamespace()
    catchup_module.PrefillChunkCap(bare, 256).apply()  # a build without the setting: left alone
    assert not vars(bare)
