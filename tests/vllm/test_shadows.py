"""Attention/MLA shadows on the real KV-cache classes of the patched release.

The prefix shared by position and the tail forked or zero-filled (full attention and MLA),
the pool pre-check against the tail arithmetic, refusals (a too-shallow chain, a request
that already has blocks) that unwind every group, and the lifecycle: after shadows and
chains are freed every block is back at its baseline ref count, the null block was never
queued, and reset_prefix_cache() succeeds.
"""

from __future__ import annotations

import pytest
from kvwarm_testing.real_kv import in_use, make_chain, make_kv_cache_manager, make_request
from vllm.kvwarm.kv.arithmetic import attention_private_blocks
from vllm.kvwarm.kv.shadows import ShadowRegistrationError, register_shadow, release_fork_retentions
from vllm.kvwarm.record import vocabulary


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def _shadow(request_id: str, ctx: int):
    return make_request(request_id, ctx + 1)


def _assert_nothing_registered(kvm, shadow, baseline):
    assert in_use(kvm.block_pool) == baseline
    for manager in kvm.coordinator.single_type_managers:
        assert shadow.request_id not in manager.req_to_blocks
        assert shadow.request_id not in manager.num_cached_block
        assert manager.take_pending_cow_copies() == []
    assert not shadow.borrowed_kv


def _assert_clean_end(kvm, *requests):
    pool = kvm.block_pool
    for request in requests:
        kvm.free(request)
    assert in_use(pool) == {}
    assert pool.null_block not in pool.free_block_queue.get_all_free_blocks()
    assert pool.reset_prefix_cache()


def test_shadow_registration_shares_prefix_and_forks_tail_with_cow():
    kvm = make_kv_cache_manager([16])
    manager = kvm.coordinator.single_type_managers[0]
    chain = make_chain(kvm, "chain", 64)
    chain_blocks = list(manager.req_to_blocks["chain"])
    shadow = _shadow("shadow", 40)

    registration = register_shadow(kvm, shadow, chain, ctx=40, steady_steps=3)

    (table,) = registration.groups
    shadow_ids = _ids(manager.req_to_blocks["shadow"])
    cow = shadow_ids[2]
    assert registration.forked
    assert shadow_ids == _ids(chain_blocks[:2]) + [cow] and cow not in _ids(chain_blocks)
    assert table.forks == [(chain_blocks[2].block_id, cow)]
    assert manager.num_cached_block["shadow"] == 2
    assert [b.ref_cnt for b in chain_blocks[:3]] == [2, 2, 2]  # shared x2, source + hit-ref
    assert kvm.block_pool.blocks[cow].ref_cnt == 2  # the shadow's + the retention
    assert shadow.borrowed_kv

    assert release_fork_retentions(kvm) == [(chain_blocks[2].block_id, cow)]
    assert chain_blocks[2].ref_cnt == 1 and kvm.block_pool.blocks[cow].ref_cnt == 1
    assert release_fork_retentions(kvm) == []
    _assert_clean_end(kvm, shadow, chain)


@pytest.mark.parametrize("fork", [True, False])
def test_mla_groups_are_borrowed_like_attention(fork):
    kvm = make_kv_cache_manager([16], attention_spec="MLAAttentionSpec")
    manager = kvm.coordinator.single_type_managers[0]
    chain = make_chain(kvm, "chain", 64)
    shadow = _shadow("shadow", 40)
    registration = register_shadow(kvm, shadow, chain, ctx=40, steady_steps=3, fork=fork)
    assert _ids(manager.req_to_blocks["shadow"])[:2] == _ids(manager.req_to_blocks["chain"][:2])
    assert len(registration.groups[0].forks if fork else registration.groups[0].zero_filled) == 1
    release_fork_retentions(kvm)
    _assert_clean_end(kvm, shadow, chain)


def test_shadow_registration_zero_fills_tail_without_cow():
    kvm = make_kv_cache_manager([16])
    manager = kvm.coordinator.single_type_managers[0]
    chain = make_chain(kvm, "chain", 64)
    chain_blocks = list(manager.req_to_blocks["chain"])
    manager.take_new_block_ids()
    shadow = _shadow("shadow", 47)

    registration = register_shadow(kvm, shadow, chain, ctx=47, steady_steps=3, fork=False)

    (table,) = registration.groups
    shadow_ids = _ids(manager.req_to_blocks["shadow"])
    assert not registration.forked and table.forks == []
    assert shadow_ids[:2] == _ids(chain_blocks[:2]) and len(shadow_ids) == 4
    assert table.zero_filled == shadow_ids[2:]
    assert manager.take_new_block_ids() == table.zero_filled  # the worker zeroes both
    assert manager.num_cached_block["shadow"] == 2
    assert release_fork_retentions(kvm) == []
    _assert_clean_end(kvm, shadow, chain)


def test_shadow_registration_takes_tail_before_touching_prefix(monkeypatch):
    kvm = make_kv_cache_manager([16, 32])
    chain = make_chain(kvm, "chain", 96)
    pool, calls = kvm.block_pool, []
    for name in ("get_new_blocks", "touch"):
        real = getattr(pool, name)
        monkeypatch.setattr(pool, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))

    shadow = _shadow("shadow", 50)
    register_shadow(kvm, shadow, chain, ctx=50, steady_steps=2)

    assert calls[:2] == ["get_new_blocks", "get_new_blocks"] and "get_new_blocks" not in calls[2:]
    monkeypatch.undo()
    release_fork_retentions(kvm)
    _assert_clean_end(kvm, shadow, chain)


@pytest.mark.parametrize("ctx, steady_steps", [(40, 3), (47, 3), (48, 0), (63, 9)])
def test_shadow_pool_shortfall_matches_tail_arithmetic(ctx, steady_steps):
    kvm = make_kv_cache_manager([16], num_blocks=12)
    chain = make_chain(kvm, "chain", 80)  # 5 of 11 usable blocks
    need = attention_private_blocks(ctx, steady_steps, 16)
    pool = kvm.block_pool
    spare = pool.get_new_blocks(pool.get_num_free_blocks() - need + 1)  # one block short
    baseline = in_use(pool)
    shadow = _shadow("shadow", ctx)

    with pytest.raises(ShadowRegistrationError) as err:
        register_shadow(kvm, shadow, chain, ctx=ctx, steady_steps=steady_steps)
    assert err.value.reason == vocabulary.POOL_EXHAUSTED and "1 more free block" in str(err.value)
    _assert_nothing_registered(kvm, shadow, baseline)

    pool.free_blocks(spare[:1])  # now exactly enough
    register_shadow(kvm, shadow, chain, ctx=ctx, steady_steps=steady_steps)
    assert pool.get_num_free_blocks() == 0
    release_fork_retentions(kvm)
    pool.free_blocks(spare[1:])
    _assert_clean_end(kvm, shadow, chain)


def test_shadow_registration_rejects_too_shallow_chain():
    kvm = make_kv_cache_manager([16])
    chain = make_chain(kvm, "chain", 48)
    baseline = in_use(kvm.block_pool)
    shadow = _shadow("shadow", 45)
    with pytest.raises(ShadowRegistrationError, match="too shallow: it holds 3 block.*needs 4") as err:
        register_shadow(kvm, shadow, chain, ctx=45, steady_steps=3)
    assert err.value.reason == vocabulary.CHAIN_TOO_SHALLOW
    _assert_nothing_registered(kvm, shadow, baseline)
    _assert_clean_end(kvm, chain)


@pytest.mark.parametrize("failure", ["pool_exhausted", "too_shallow", "fork_fails"])
def test_shadow_registration_unwinds_earlier_groups_on_failure(monkeypatch, failure):
    # Group 0 (bs 32) is deep enough for ctx 40 + 8; group 1 (bs 16) holds 48 tokens only.
    kvm = make_kv_cache_manager([32, 16])
    chain = make_chain(kvm, "chain", 48 if failure == "too_shallow" else 96)
    pool = kvm.block_pool
    baseline = in_use(pool)
    if failure == "pool_exhausted":  # the second group's allocation fails after the first's
        real, calls = pool.get_new_blocks, []

        def get_new_blocks(n):
            calls.append(n)
            if len(calls) == 2:
                raise ValueError("Cannot get free blocks from the pool (injected)")
            return real(n)

        monkeypatch.setattr(pool, "get_new_blocks", get_new_blocks)
    elif failure == "fork_fails":  # the second group's fork fails after the first committed
        second = kvm.coordinator.single_type_managers[1]
        monkeypatch.setattr(second, "_apply_cow", lambda *a: (_ for _ in ()).throw(AssertionError("injected")))
    shadow = _shadow("shadow", 40)

    with pytest.raises((ShadowRegistrationError, ValueError, AssertionError)):
        register_shadow(kvm, shadow, chain, ctx=40, steady_steps=8)

    monkeypatch.undo()
    _assert_nothing_registered(kvm, shadow, baseline)
    _assert_clean_end(kvm, chain)


@pytest.mark.parametrize("fork", [True, False])
def test_shadow_lifecycle_returns_every_reference(fork):
    kvm = make_kv_cache_manager([16, 32], num_blocks=96)
    chains = [make_chain(kvm, f"chain{i}", 200 + 37 * i) for i in range(2)]
    baseline = in_use(kvm.block_pool)
    registered, forks = [], []
    for i, ctx in enumerate([31, 32, 33, 100, 150, 190]):
        shadow = _shadow(f"shadow{i}", ctx)
        registration = register_shadow(kvm, shadow, chains[i % 2], ctx=ctx, steady_steps=3, fork=fork)
        registered.append(shadow)
        forks += [pair for table in registration.groups for pair in table.forks]
    assert sorted(release_fork_retentions(kvm)) == sorted(forks) and bool(forks) == fork
    for shadow in registered:
        kvm.free(shadow)
    assert in_use(kvm.block_pool) == baseline
    _assert_clean_end(kvm, *chains)


def test_steady_steps_of_a_borrowed_shadow_hash_nothing():
    """The stock running loop (allocate_slots one token per step) across a block boundary:
    the shadow's private blocks get no hash and the chain's keys are left alone."""
    kvm = make_kv_cache_manager([16])
    manager = kvm.coordinator.single_type_managers[0]
    chain = make_chain(kvm, "chain", 64)
    hashes_before = {b.block_id: b.block_hash for b in manager.req_to_blocks["chain"]}
    shadow = _shadow("shadow", 30)
    shadow.append_output_token_ids([5] * 8)  # what the steady steps sample
    register_shadow(kvm, shadow, chain, ctx=30, steady_steps=1)
    release_fork_retentions(kvm)
    shadow.num_computed_tokens = 30
    for _ in range(6):  # writes positions 30..35, crossing into block 2 at 32
        assert kvm.allocate_slots(shadow, 1) is not None
        shadow.num_computed_tokens += 1

    table = manager.req_to_blocks["shadow"]
    assert len(table) == 3 and manager.num_cached_block["shadow"] == 1
    assert all(b.block_hash is None for b in table[1:])
    assert {b.block_id: b.block_hash for b in manager.req_to_blocks["chain"]} == hashes_before
    _assert_clean_end(kvm, shadow, chain)


@pytest.mark.parametrize("fork", [True, False])
def test_a_shadow_with_keys_of_its_own_caches_only_the_blocks_it_fills(fork):
    """own_keys on an attention layout: the stock running loop caches the tail block the
    shadow fills under the shadow's salted key, as it would a natural request's; the
    borrowed prefix is never re-keyed and no key of the shadow's is the chain's."""
    kvm = make_kv_cache_manager([16])
    manager = kvm.coordinator.single_type_managers[0]
    chain = make_chain(kvm, "chain", 64)
    hashes_before = {b.block_id: b.block_hash for b in manager.req_to_blocks["chain"]}
    shadow = make_request("shadow", 31, cache_salt="shadow")  # the chain's tokens, keys of its own
    register_shadow(kvm, shadow, chain, ctx=30, steady_steps=1, fork=fork, own_keys=True)
    release_fork_retentions(kvm)
    assert not shadow.borrowed_kv and manager.num_cached_block["shadow"] == 1
    shadow.num_computed_tokens = 30
    for _ in range(6):  # writes positions 30..35: block 1 full at 32, block 2 partial
        shadow.append_output_token_ids(5)
        assert kvm.allocate_slots(shadow, 1) is not None
        shadow.num_computed_tokens += 1

    table = manager.req_to_blocks["shadow"]
    assert manager.num_cached_block["shadow"] == 2
    assert table[1].block_hash is not None and table[2].block_hash is None
    assert {b.block_id: b.block_hash for b in manager.req_to_blocks["chain"]} == hashes_before
    assert table[1].block_hash not in hashes_before.values()
    _assert_clean_end(kvm, shadow, chain)


def test_registration_refuses_a_request_that_already_has_blocks():
    kvm = make_kv_cache_manager([16])
    chain = make_chain(kvm, "chain", 64)
    other = make_chain(kvm, "other", 20)
    baseline = in_use(kvm.block_pool)
    with pytest.raises(ValueError, match="already has blocks"):
        register_shadow(kvm, other, chain, ctx=20, steady_steps=2)
    assert in_use(kvm.block_pool) == baseline
    _assert_clean_end(kvm, chain, other)
