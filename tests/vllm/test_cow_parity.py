"""Copy-on-write parity: upstream's fork semantics, on every release this project builds.

The same tests run against stock releases that have copy-on-write and patched releases whose
series backports it (releases.toml: stock_tests, series_tests); they name only vLLM's own
attributes, never a version.
"""

from __future__ import annotations

import pytest
import torch
from kvwarm_testing.real_kv import attention_manager, in_use, make_request, make_scheduler, mamba_align_manager


def borrow(pool, manager, owner: str, borrower: str) -> list:
    """What a warm-up shadow does: share the owner's blocks by reference."""
    blocks = list(manager.req_to_blocks[owner])
    pool.touch([b for b in blocks if not b.is_null])
    manager.req_to_blocks[borrower] = blocks
    return blocks


@pytest.mark.parametrize("make_manager", [attention_manager, mamba_align_manager])
def test_apply_cow_retains_both_ends_until_released(pool, make_manager):
    manager = make_manager(pool)
    manager.allocate_new_blocks("chain", 40, 40)
    baseline = in_use(pool)
    blocks = borrow(pool, manager, "chain", "shadow")
    source = blocks[2]
    (fork,) = pool.get_new_blocks(1)
    manager._apply_cow("shadow", 2, source, fork)
    assert manager.req_to_blocks["shadow"][2] is fork
    assert manager.req_to_blocks["chain"][2] is source
    assert source.ref_cnt == 2  # the chain's + the shadow's touch, kept as the retention
    assert fork.ref_cnt == 2  # the shadow's + one retention
    pairs = manager.take_pending_cow_copies()
    assert pairs == [(source, fork)]
    assert manager.take_pending_cow_copies() == []  # drained
    pool.free_blocks([block for pair in pairs for block in pair])  # the scheduler's release
    assert source.ref_cnt == baseline[source.block_id] and fork.ref_cnt == 1
    manager.free("shadow")
    assert in_use(pool) == baseline
    manager.free("chain")
    assert in_use(pool) == {}
    assert pool.reset_prefix_cache()


def test_apply_cow_refuses_a_slot_that_does_not_hold_the_source(pool):
    manager = attention_manager(pool)
    manager.allocate_new_blocks("r", 40, 40)
    (stranger,) = pool.get_new_blocks(1)
    (fork,) = pool.get_new_blocks(1)
    with pytest.raises(AssertionError):
        manager._apply_cow("r", 1, stranger, fork)
    assert manager.take_pending_cow_copies() == []


def test_drain_order_across_groups(pool):
    """Groups drain in manager order, pairs in the order they were forked."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    first, second = attention_manager(pool, 0), attention_manager(pool, 1)
    for manager in (first, second):
        manager.allocate_new_blocks("chain", 48, 48)
        borrow(pool, manager, "chain", "shadow")
    forks = []
    for manager, idx in ((second, 0), (first, 2), (first, 1)):
        (fork,) = pool.get_new_blocks(1)
        manager._apply_cow("shadow", idx, manager.req_to_blocks["shadow"][idx], fork)
        forks.append(fork)
    pairs = first.take_pending_cow_copies() + second.take_pending_cow_copies()
    assert [dst for _, dst in pairs] == [forks[1], forks[2], forks[0]]
    copies = [KVCacheBlockCopy(src.block_id, dst.block_id) for src, dst in pairs]
    assert copies[0].src_block_id == first.req_to_blocks["chain"][2].block_id
    assert copies[0] == (pairs[0][0].block_id, pairs[0][1].block_id)


def _fork_running_tail(scheduler, request_id: str):
    """Fork the last block of a scheduled request through its group's manager."""
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    table = manager.req_to_blocks[request_id]
    source = table[-1]
    scheduler.kv_cache_manager.block_pool.touch([source])  # the hit-ref a borrower holds
    (fork,) = scheduler.kv_cache_manager.block_pool.get_new_blocks(1)
    manager._apply_cow(request_id, len(table) - 1, source, fork)
    return source, fork


@pytest.mark.parametrize("defer", [False, True])
def test_schedule_puts_copies_on_its_output_and_releases_retentions(tmp_path, defer):
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    scheduler = make_scheduler(tmp_path, defer_block_free=defer)
    request = make_request("r", 40)
    scheduler.add_request(request)
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"r": 40}
    assert first.kv_cache_block_copies is None  # nothing forked: as stock
    source, fork = _fork_running_tail(scheduler, "r")
    assert (source.ref_cnt, fork.ref_cnt) == (2, 2)
    scheduler.add_request(make_request("other", 20, token=9))  # a step that runs on the worker
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"other": 20}
    assert second.kv_cache_block_copies == [KVCacheBlockCopy(source.block_id, fork.block_id)]
    if defer:
        # Held until the step that runs the copy has been processed.
        assert (source.ref_cnt, fork.ref_cnt) == (2, 2)
        scheduler.processed_step_seq = scheduler.sched_step_seq
        scheduler._drain_deferred_frees()
    # The source had the request's block ref + the touch: back to 1 (its retention is gone
    # and the request no longer holds it); the fork is owned by the request alone.
    assert (source.ref_cnt, fork.ref_cnt) == (1, 1)
    assert scheduler.schedule().kv_cache_block_copies is None  # drained
    pool = scheduler.kv_cache_manager.block_pool
    pool.free_blocks([source])  # the touch this test took stands in for a chain's ref
    scheduler.finish_requests(["r", "other"], _finished_status())
    if defer:
        scheduler.processed_step_seq = scheduler.sched_step_seq
        scheduler._drain_deferred_frees()
    assert in_use(pool) == {}
    assert scheduler.reset_prefix_cache()


def _finished_status():
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


def test_scheduler_output_with_copies_pickles():
    import dataclasses
    import pickle

    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.core.sched.output import SchedulerOutput

    assert "kv_cache_block_copies" in {f.name for f in dataclasses.fields(SchedulerOutput)}
    output = SchedulerOutput.make_empty()
    assert output.kv_cache_block_copies is None
    output.kv_cache_block_copies = [KVCacheBlockCopy(3, 5)]
    assert pickle.loads(pickle.dumps(output)).kv_cache_block_copies == [(3, 5)]


def _copy_refuses(kv_caches, num_blocks: int) -> str | None:
    """Why this build's worker copy refuses these caches (a scratch copy 0 -> 1), or None.
    Releases differ: some take Mamba state as lists of views, some only tensors; some copy
    any block-major storage, some only along dim 0."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    try:
        copy_kv_cache_blocks_inplace(kv_caches, num_blocks, [KVCacheBlockCopy(0, 1)])
    except Exception as err:  # noqa: BLE001 - any refusal means the build lacks the capability
        return f"{type(err).__name__}: {err}"
    return None


def test_worker_copy_on_attention_pages(torch_device):
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    num_blocks = 6
    # Attention: blocks-first [num_blocks, 2, block, heads, dim].
    attention = torch.randn(num_blocks, 2, 4, 1, 8, device=torch_device)
    before = attention.clone()
    # 4 is both a destination and a source: every copy reads the pages as they were, and a
    # storage seen twice (the repeated entry) is copied once, or 5 would get 1.
    copies = [KVCacheBlockCopy(1, 4), KVCacheBlockCopy(4, 5)]
    copy_kv_cache_blocks_inplace([attention, attention], num_blocks, copies)
    for src, dst in copies:
        assert torch.equal(attention[dst], before[src])
    for untouched in (0, 1, 2, 3):
        assert torch.equal(attention[untouched], before[untouched])


def _mamba_page(num_blocks, device):
    """One page per block holding a conv and a temporal state, two views of one storage."""
    page = torch.randn(num_blocks, 3 * 4 + 5 * 2, device=device)
    return page, page[:, :12].view(num_blocks, 3, 4), page[:, 12:].view(num_blocks, 5, 2)


def test_worker_copy_on_mamba_state_lists(torch_device):
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    num_blocks = 6
    _, conv, temporal = _mamba_page(num_blocks, torch_device)
    refused = _copy_refuses([[conv, temporal]], num_blocks)
    if refused:
        pytest.skip(f"this build's worker copy takes no Mamba state lists ({refused})")
    page, conv, temporal = _mamba_page(num_blocks, torch_device)
    before = page.clone()
    copies = [KVCacheBlockCopy(1, 4), KVCacheBlockCopy(4, 5)]
    copy_kv_cache_blocks_inplace([[conv, temporal]], num_blocks, copies)
    for src, dst in copies:
        assert torch.equal(conv[dst], before[src, :12].view(3, 4))
        assert torch.equal(temporal[dst], before[src, 12:].view(5, 2))
    for untouched in (0, 1, 2, 3):
        assert torch.equal(page[untouched], before[untouched])


def test_worker_copy_on_a_mamba_page_tensor(torch_device):
    """Mamba state handed over as its page tensor, as builds that take tensors only get it."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    page, conv, temporal = _mamba_page(6, torch_device)
    before = page.clone()
    copy_kv_cache_blocks_inplace([page], 6, [KVCacheBlockCopy(2, 3)])
    assert torch.equal(conv[3], before[2, :12].view(3, 4)) and torch.equal(temporal[3], before[2, 12:].view(5, 2))
    assert torch.equal(page[:3], before[:3]) and torch.equal(page[4:], before[4:])


def test_block_major_view_of_a_permuted_storage_is_accepted(torch_device):
    """What counts is the storage, not the dimension order: hybrid layouts re-stride
    attention so blocks come first in memory while the tensor's shape does not. Builds
    that copy along dim 0 only refuse such a view (test_worker_copy_layout: with a named
    error, before anything is written)."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    num_blocks = 6
    refused = _copy_refuses([torch.zeros(num_blocks, 2, 4, 8, device=torch_device).permute(1, 0, 2, 3)], num_blocks)
    if refused:
        pytest.skip(f"this build copies along dim 0 only and refuses a permuted view ({refused})")
    storage = torch.randn(num_blocks, 2, 4, 8, device=torch_device)  # blocks first in memory
    view = storage.permute(1, 0, 2, 3)  # shaped K/V-first, strided blocks-first
    copy_kv_cache_blocks_inplace([view], num_blocks, [KVCacheBlockCopy(1, 4)])
    assert torch.equal(storage[4], storage[1])
