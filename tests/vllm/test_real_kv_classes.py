"""The installed patched wheel's own BlockPool and managers, exercised on CPU."""

from __future__ import annotations

from real_kv import attention_manager, in_use, mamba_align_manager


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
