"""Random shadow lifecycles on the real KV-cache classes, with failures injected.

Each example builds a real KVCacheManager (one to three attention groups of random block
sizes), prefills a chain, registers a few shadows (CoW or zero-fill, random contexts and
headroom) while one call of the pool or a manager may be made to fail, then releases
everything. After every registration attempt and at the end the invariants must hold:
a failed registration leaves no trace, a successful one has the planned tables, and the
pool returns to its baseline, with the null block never queued and reset_prefix_cache()
succeeding.

CI runs KVWARM_PROPERTY_EXAMPLES (default 2000) examples; set it higher for a long soak.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from real_kv import in_use, make_chain, make_kv_cache_manager, make_request
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vllm.kvwarm.arithmetic import attention_private_blocks, cdiv
from vllm.kvwarm.shadows import (
    CHAIN_TOO_SHALLOW, POOL_EXHAUSTED, ShadowRegistrationError, register_shadow, release_fork_retentions,
)

EXAMPLES = int(os.environ.get("KVWARM_PROPERTY_EXAMPLES", "2000"))
# Every call a registration makes that could fail in the stage or commit phase.
FAULT_POINTS = ("pool.get_new_blocks", "pool.touch", "manager.adopt_blocks", "manager._apply_cow")


class InjectedFault(RuntimeError):
    pass


@contextmanager
def fail_on_call(kvm, point: str | None, nth: int):
    """Make the nth call (0-based, over all groups) of `point` raise InjectedFault."""
    if point is None:
        yield
        return
    owner_kind, name = point.split(".")
    owners = [kvm.block_pool] if owner_kind == "pool" else list(kvm.coordinator.single_type_managers)
    calls = []

    def wrap(real):
        def faulty(*args, **kwargs):
            calls.append(name)
            if len(calls) - 1 == nth:
                raise InjectedFault(f"{point} call {nth}")
            return real(*args, **kwargs)
        return faulty

    for owner in owners:
        setattr(owner, name, wrap(getattr(owner, name)))
    try:
        yield
    finally:
        for owner in owners:
            delattr(owner, name)  # the instance attribute shadowed the class's method


@st.composite
def lifecycles(draw):
    # Distinct sizes: vLLM puts layers with identical specs into one group.
    block_sizes = draw(st.lists(st.sampled_from([16, 32, 64]), min_size=1, max_size=3, unique=True))
    chain_tokens = draw(st.integers(1, 300))
    chain_blocks = sum(cdiv(chain_tokens, bs) for bs in block_sizes)
    return {
        "block_sizes": block_sizes,
        "chain_tokens": chain_tokens,
        # From no spare block at all to plenty, so the pool pre-check is exercised.
        "num_blocks": 1 + chain_blocks + draw(st.integers(0, 24)),
        # Mostly within the chain's depth, sometimes past it.
        "shadows": draw(st.lists(st.tuples(st.integers(1, chain_tokens + 16), st.integers(0, 6)),
                                 min_size=1, max_size=4)),
        "fork": draw(st.booleans()),
        "fault": draw(st.none() | st.tuples(st.sampled_from(FAULT_POINTS), st.integers(0, 10))),
    }


def _expected_refusal(kvm, chain_tables, ctx, headroom) -> str | None:
    """The reason the arithmetic predicts (the pool pre-check comes first), or None."""
    sizes = [m.block_size for m in kvm.coordinator.single_type_managers]
    need = sum(attention_private_blocks(ctx, headroom, bs) for bs in sizes)
    if need > kvm.block_pool.get_num_free_blocks():
        return POOL_EXHAUSTED
    if any(cdiv(ctx + 1 + headroom, bs) > len(chain) for bs, chain in zip(sizes, chain_tables)):
        return CHAIN_TOO_SHALLOW
    return None


def _check_registered(kvm, shadow, registration, chain_tables):
    for manager, table, chain in zip(kvm.coordinator.single_type_managers, registration.groups, chain_tables):
        bs, ctx, headroom = manager.block_size, registration.ctx, registration.headroom
        n_shared, n_total = ctx // bs, cdiv(ctx + 1 + headroom, bs)
        ids = [b.block_id for b in manager.req_to_blocks[shadow.request_id]]
        assert len(ids) == n_total and table.num_shared == n_shared
        assert ids[:n_shared] == chain[:n_shared]
        assert not set(ids[n_shared:]) & set(chain)  # the tail is private
        assert manager.num_cached_block[shadow.request_id] == n_shared
        if registration.forked:
            assert table.forks == list(zip(chain[n_shared:n_total], ids[n_shared:]))
        else:
            assert table.zero_filled == ids[n_shared:]
    assert shadow.borrowed_kv


def _check_unregistered(kvm, shadow, pool_before, pending_before):
    assert in_use(kvm.block_pool) == pool_before
    for manager, pending in zip(kvm.coordinator.single_type_managers, pending_before):
        assert shadow.request_id not in manager.req_to_blocks
        assert shadow.request_id not in manager.num_cached_block
        assert manager._pending_cow_copies == pending
    assert not shadow.borrowed_kv


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lifecycles())
def test_random_shadow_lifecycles_keep_the_pool_whole(case):
    kvm = make_kv_cache_manager(case["block_sizes"], num_blocks=case["num_blocks"])
    pool, managers = kvm.block_pool, kvm.coordinator.single_type_managers
    chain = make_chain(kvm, "chain", case["chain_tokens"])
    chain_tables = [[b.block_id for b in m.req_to_blocks["chain"]] for m in managers]
    baseline = in_use(pool)
    registered, forks = [], []
    point, nth = case["fault"] or (None, 0)

    with fail_on_call(kvm, point, nth):
        for i, (ctx, headroom) in enumerate(case["shadows"]):
            shadow = make_request(f"shadow{i}", ctx + 1)
            pool_before = in_use(pool)
            pending_before = [list(m._pending_cow_copies) for m in managers]
            expected = _expected_refusal(kvm, chain_tables, ctx, headroom)
            try:
                registration = register_shadow(kvm, shadow, "chain", ctx, headroom, fork=case["fork"])
            except InjectedFault:
                event(f"refused: injected {point}")
                _check_unregistered(kvm, shadow, pool_before, pending_before)
                continue
            except ShadowRegistrationError as err:
                event(f"refused: {err.reason}")
                assert err.reason == expected
                _check_unregistered(kvm, shadow, pool_before, pending_before)
                continue
            assert expected is None, f"registered although the arithmetic says {expected}"
            event(f"registered ({len(managers)} group(s), {'fork' if registration.forked else 'zero-fill'})")
            _check_registered(kvm, shadow, registration, chain_tables)
            registered.append(shadow)
            forks += [pair for table in registration.groups for pair in table.forks]

    assert sorted(release_fork_retentions(kvm)) == sorted(forks)
    for shadow in registered:
        kvm.free(shadow)
    assert in_use(pool) == baseline
    kvm.free(chain)
    assert in_use(pool) == {}
    assert pool.null_block not in pool.free_block_queue.get_all_free_blocks()
    assert pool.reset_prefix_cache()
