"""The installed patched wheel's own BlockPool and managers, exercised on CPU."""

from __future__ import annotations

import pytest
from kvwarm_testing.real_kv import (
    attention_manager,
    in_use,
    make_chain,
    make_kv_cache_manager,
    make_request,
    mamba_align_manager,
)


def test_block_pool_allocate_touch_free_reset(pool):
    free_at_start = pool.get_num_free_blocks()
    assert free_at_start == pool.num_gpu_blocks - 1  # the null block is never free
    blocks = pool.get_new_blocks(4)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1, 1]
    assert pool.get_num_free_blocks() == free_at_start - 4
    pool.touch(blocks)  # the borrow primitive: one more reference each
    assert in_use(pool) == {b.block_id: 2 for b in blocks}
    assert not pool.reset_prefix_cache()  # blocks still held: refused
    pool.free_blocks(blocks)
    assert in_use(pool) == {b.block_id: 1 for b in blocks}
    pool.free_blocks(reversed(blocks))
    assert in_use(pool) == {}
    assert pool.get_num_free_blocks() == free_at_start
    assert pool.reset_prefix_cache()


def test_touch_takes_a_free_block_out_of_the_queue(pool):
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    free = pool.get_num_free_blocks()
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == free - 1
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()


def test_attention_manager_allocates_by_block_and_frees(pool):
    manager = attention_manager(pool)
    new = manager.allocate_new_blocks("r", 40, 40)
    assert len(new) == 3 == len(manager.req_to_blocks["r"])  # ceil(40 / 16)
    more = manager.allocate_new_blocks("r", 49, 49)
    assert len(more) == 1 and len(manager.req_to_blocks["r"]) == 4
    assert set(in_use(pool)) == {b.block_id for b in manager.req_to_blocks["r"]}
    manager.free("r")
    assert in_use(pool) == {} and "r" not in manager.req_to_blocks
    assert pool.reset_prefix_cache()


def test_align_mode_mamba_keeps_one_state_block_at_the_token_slot(pool):
    attention, mamba = attention_manager(pool), mamba_align_manager(pool)
    attention.allocate_new_blocks("r", 40, 40)
    mamba.allocate_new_blocks("r", 40, 40)
    table = mamba.req_to_blocks["r"]
    # Nulls before the state block at slot cdiv(40, 16) - 1 = 2.
    assert [b.is_null for b in table] == [True, True, False]
    state = table[2]
    # Crossing into the next block appends a fresh state block ...
    mamba.allocate_new_blocks("r", 49, 49)
    assert len(mamba.req_to_blocks["r"]) == 4 and mamba.req_to_blocks["r"][2] is state
    # ... and once the old one is behind the computed tokens it is freed and nulled.
    mamba.remove_skipped_blocks("r", 49)
    assert [b.is_null for b in mamba.req_to_blocks["r"]] == [True, True, True, False]
    assert state.ref_cnt == 0
    attention.free("r")
    mamba.free("r")
    assert in_use(pool) == {}
    assert pool.reset_prefix_cache()


def test_a_group_allocating_from_a_pool_of_its_own_is_refused_by_name():
    """A group whose manager has its own block pool (how a HiSparse host tier is built: a
    plain full-attention spec, another pool) is never borrowed as plain attention."""
    from vllm.kvwarm.kv.layout import ATTENTION, OWN_POOL, group_layouts
    from vllm.kvwarm.kv.shadows import ShadowRegistrationError, register_shadow
    from vllm.kvwarm.record import vocabulary
    from vllm.kvwarm.record.vocabulary import COPY

    kvm = make_kv_cache_manager([16, 32])
    chain = make_chain(kvm, "chain", 64)
    host = kvm.coordinator.single_type_managers[1]
    host.block_pool = make_kv_cache_manager([16], num_blocks=8).block_pool  # another pool
    assert [g.kind for g in group_layouts(kvm)] == [ATTENTION, OWN_POOL]
    with pytest.raises(ShadowRegistrationError) as err:
        register_shadow(kvm, make_request("shadow", 40), chain, ctx=40, steady_steps=3, state_mode=COPY)
    assert err.value.reason == vocabulary.LAYOUT_UNSUPPORTED and "group 1 (own_pool: " in str(err.value)
    assert kvm.coordinator.single_type_managers[0].req_to_blocks.get("shadow") in (None, [])


def _checkpoint_fields(checkpoint: int) -> dict:
    """MambaSpec fields for `checkpoint` prefill checkpoint blocks (real models of builds
    that have them use one), or a skip where the build's MambaSpec has no such field."""
    import dataclasses

    from vllm.v1.kv_cache_interface import MambaSpec

    if not checkpoint:
        return {}
    fields = {f.name for f in dataclasses.fields(MambaSpec)}
    if "num_prefill_checkpoint_blocks" not in fields:
        pytest.skip("this build's Mamba spec has no prefill checkpoint blocks")
    # Some builds with checkpoint blocks also align them (a field of its own; 1: every block).
    return {
        "num_prefill_checkpoint_blocks": checkpoint,
        **({"prefill_checkpoint_alignment": 1} if "prefill_checkpoint_alignment" in fields else {}),
    }


def _state_shadow_decodes(mode: str, speculative: int, checkpoint: int = 0, ctx: int = 100, steps: int = 40):
    """A chain of 192 tokens, then a state shadow at ctx decoding `steps` tokens through the
    real KVCacheManager, across the state block boundary at 128 (where align mode nulls the
    old slot and, with speculative blocks, relocates the scratch block)."""
    from vllm.kvwarm.kv.shadows import register_shadow, release_fork_retentions

    kvm = make_kv_cache_manager(
        [16], num_blocks=96, state_groups=[(64, speculative, "align")], state_extra=_checkpoint_fields(checkpoint)
    )
    attention, state = kvm.coordinator.single_type_managers
    chain = make_chain(kvm, "chain", 192)
    chain_tables = [list(m.req_to_blocks["chain"]) for m in (attention, state)]
    baseline = in_use(kvm.block_pool)
    shadow = make_request("shadow", ctx + 1)
    register_shadow(kvm, shadow, chain, ctx=ctx, steady_steps=steps, state_mode=mode)
    release_fork_retentions(kvm)
    shadow.num_computed_tokens = ctx  # admitted one short of its prompt
    for _ in range(steps):
        assert kvm.allocate_slots(shadow, 1) is not None
        shadow.num_computed_tokens += 1
        shadow.append_output_token_ids(7)
    return kvm, chain, chain_tables, baseline, shadow


@pytest.mark.parametrize("ctx", [100, 111])  # 112 ends on a prefix-match unit: a checkpoint boundary
@pytest.mark.parametrize("checkpoint", [0, 1])
@pytest.mark.parametrize("speculative", [0, 1])
@pytest.mark.parametrize("mode", ["copy", "inplace"])
def test_a_state_shadow_decodes_across_a_state_block_and_leaves_the_chain_alone(mode, speculative, checkpoint, ctx):
    kvm, chain, chain_tables, baseline, shadow = _state_shadow_decodes(mode, speculative, checkpoint, ctx)
    attention, state = kvm.coordinator.single_type_managers
    assert [list(m.req_to_blocks["chain"]) for m in (attention, state)] == chain_tables
    table = state.req_to_blocks["shadow"]
    live = [b for b in table if not b.is_null]
    assert len(live) == 1 + speculative  # one state block at the current slot, then scratch
    assert table[140 // 64] is live[0] and live[0] not in chain_tables[1]  # a block of its own past 128
    kvm.free(shadow)
    assert in_use(kvm.block_pool) == baseline
    kvm.free(chain)
    assert in_use(kvm.block_pool) == {}
