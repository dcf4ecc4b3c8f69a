"""What the tests of the recurrent-state hand-off share (test_state_shadows.py,
test_state_shadows_placement.py): the hybrid KV cache manager they build, the release that
must leave the pool as it found it, and the build profiles the mode table is about."""

from __future__ import annotations

from kvwarm_testing.real_kv import in_use, make_kv_cache_manager
from vllm.kvwarm.kv.shadows import release_fork_retentions
from vllm.kvwarm.kv.state_mode import StateBuild


def hybrid(num_blocks=64, speculative=0, mode="align"):
    """(the manager, its attention manager, its state manager): attention bs 16 beside a
    state group of block size 64 in `mode` with `speculative` scratch blocks."""
    kvm = make_kv_cache_manager([16], num_blocks=num_blocks, state_groups=[(64, speculative, mode)])
    attention, state = kvm.coordinator.single_type_managers
    return kvm, attention, state


def block_ids(blocks):
    return [b.block_id for b in blocks]


def release_all(kvm, *requests):
    """The requests freed with every fork retention: nothing left in use, the null block
    never in the free queue, and the prefix cache resets."""
    release_fork_retentions(kvm)
    for request in requests:
        kvm.free(request)
    pool = kvm.block_pool
    assert in_use(pool) == {}
    assert pool.null_block not in pool.free_block_queue.get_all_free_blocks()
    assert pool.reset_prefix_cache()


def no_align_bookkeeping_left(manager, request_id):
    """The align-mode manager keeps nothing of the request (unwound or freed)."""
    for name in ("req_to_blocks", "num_cached_block", "last_state_block_idx", "_allocated_block_reqs"):
        assert request_id not in getattr(manager, name, ()), name


# The build profiles the mode table is about: what each build's state managers can do.
STOCK_025 = StateBuild(can_fork=False, inplace_ok=True)  # no CoW; no partial-tail hashing
PATCHED_025 = StateBuild(can_fork=True, inplace_ok=True)  # CoW backport
STOCK_028 = StateBuild(can_fork=True, inplace_ok=False)  # hashes partial tails of borrowers
PATCHED_028 = StateBuild(can_fork=True, inplace_ok=True)  # borrowed_kv exemption
