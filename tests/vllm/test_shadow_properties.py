"""Random shadow lifecycles on the real KV-cache classes, with failures injected.

Each example builds a real KVCacheManager (one to three attention groups of random block
sizes, or one or two next to an align-mode state group with 0 or 1 speculative blocks),
prefills a chain, registers a few shadows (attention tails forked or zero-filled, state
by copy or in place, random contexts and steady steps, crossing state slots or not) while
one call of the pool or a manager may be made to fail, then releases everything. After every
registration attempt and at the end the invariants must hold:
a failed registration leaves no trace, a successful one has the planned tables, and the
pool returns to its baseline, with the null block never queued and reset_prefix_cache()
succeeding.

CI runs KVWARM_PROPERTY_EXAMPLES (default 2000) examples; set it higher for a long soak.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kvwarm_testing.real_kv import in_use, make_chain, make_kv_cache_manager, make_request
from vllm.kvwarm.kv.arithmetic import cdiv, shadow_private_blocks
from vllm.kvwarm.kv.layout import ATTENTION, STATE_ALIGN, group_layouts
from vllm.kvwarm.kv.shadows import ShadowRegistrationError, register_shadow, release_fork_retentions
from vllm.kvwarm.record.vocabulary import CHAIN_TOO_SHALLOW, COPY, INPLACE, POOL_EXHAUSTED

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
    # Distinct attention sizes: vLLM puts layers with identical specs into one group.
    block_sizes = draw(st.lists(st.sampled_from([16, 32, 64]), min_size=1, max_size=3, unique=True))
    # Optionally an align-mode state group (block size, speculative blocks) after them.
    state = draw(st.none() | st.tuples(st.sampled_from([16, 32, 64]), st.integers(0, 1)))
    if state is not None:
        block_sizes = block_sizes[:2]
    chain_tokens = draw(st.integers(1, 300))
    chain_blocks = sum(cdiv(chain_tokens, bs) for bs in block_sizes)
    if state is not None:
        chain_blocks += 1 + state[1]
    return {
        "block_sizes": block_sizes,
        "state_groups": [(state[0], state[1], "align")] if state else [],
        "state_mode": draw(st.sampled_from([COPY, INPLACE])) if state else None,
        "chain_tokens": chain_tokens,
        # From no spare block at all to plenty, so the pool pre-check is exercised.
        "num_blocks": 1 + chain_blocks + draw(st.integers(0, 24)),
        # Mostly within the chain's depth, sometimes past it; crossing and non-crossing.
        "shadows": draw(
            st.lists(st.tuples(st.integers(1, chain_tokens + 16), st.integers(0, 6)), min_size=1, max_size=4)
        ),
        "fork": draw(st.booleans()),
        "fault": draw(st.none() | st.tuples(st.sampled_from(FAULT_POINTS), st.integers(0, 10))),
    }


def _expected_refusal(kvm, chain_tables, ctx, steady_steps, state_mode) -> str | None:
    """The reason the arithmetic predicts (the pool pre-check comes first), or None."""
    layouts = group_layouts(kvm)
    if shadow_private_blocks(layouts, ctx, steady_steps, state_mode == COPY) > kvm.block_pool.get_num_free_blocks():
        return POOL_EXHAUSTED
    if any(
        g.kind == ATTENTION and cdiv(ctx + 1 + steady_steps, g.block_size) > len(chain)
        for g, chain in zip(layouts, chain_tables)
    ):
        return CHAIN_TOO_SHALLOW
    return None


def _check_registered(kvm, chain, shadow, registration, chain_tables):
    ctx, steady_steps = registration.ctx, registration.steady_steps
    for group, table, chain_ids in zip(group_layouts(kvm), registration.groups, chain_tables):
        manager, bs = group.manager, group.block_size
        blocks = manager.req_to_blocks[shadow.request_id]
        ids = [b.block_id for b in blocks]
        if group.kind == STATE_ALIGN:
            read, last = (ctx - 1) // bs, (ctx + steady_steps) // bs
            state = chain_ids[(chain.num_computed_tokens - 1) // bs]
            assert len(ids) == last + 1 + group.num_speculative_blocks == manager.num_cached_block[shadow.request_id]
            assert all(b.is_null for b in blocks[:read]) and table.state_slot == read
            assert ids[read + 1 :] == table.blanks and not set(table.blanks) & set(chain_ids)
            if registration.state_mode == COPY:
                assert table.forks == [(state, ids[read])]
            else:
                assert ids[read] == state and table.forks == []
            continue
        n_shared, n_total = ctx // bs, cdiv(ctx + 1 + steady_steps, bs)
        assert len(ids) == n_total and table.num_shared == n_shared
        assert ids[:n_shared] == chain_ids[:n_shared]
        assert not set(ids[n_shared:]) & set(chain_ids)  # the tail is private
        assert manager.num_cached_block[shadow.request_id] == n_shared
        if registration.forked:
            assert table.forks == list(zip(chain_ids[n_shared:n_total], ids[n_shared:]))
        else:
            assert table.zero_filled == ids[n_shared:]
    assert shadow.borrowed_kv


def _check_unregistered(kvm, shadow, pool_before, pending_before):
    assert in_use(kvm.block_pool) == pool_before
    for manager, pending in zip(kvm.coordinator.single_type_managers, pending_before):
        for bookkeeping in ("req_to_blocks", "num_cached_block", "last_state_block_idx", "_allocated_block_reqs"):
            assert shadow.request_id not in getattr(manager, bookkeeping, ()), bookkeeping
        assert manager._pending_cow_copies == pending
    assert not shadow.borrowed_kv


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lifecycles())
def test_random_shadow_lifecycles_keep_the_pool_whole(case):
    kvm = make_kv_cache_manager(case["block_sizes"], num_blocks=case["num_blocks"], state_groups=case["state_groups"])
    pool, managers = kvm.block_pool, kvm.coordinator.single_type_managers
    chain = make_chain(kvm, "chain", case["chain_tokens"])
    chain_tables = [[b.block_id for b in m.req_to_blocks["chain"]] for m in managers]
    baseline = in_use(pool)
    registered, forks = [], []
    point, nth = case["fault"] or (None, 0)

    with fail_on_call(kvm, point, nth):
        for i, (ctx, steady_steps) in enumerate(case["shadows"]):
            shadow = make_request(f"shadow{i}", ctx + 1)
            pool_before = in_use(pool)
            pending_before = [list(m._pending_cow_copies) for m in managers]
            expected = _expected_refusal(kvm, chain_tables, ctx, steady_steps, case["state_mode"])
            try:
                registration = register_shadow(
                    kvm, shadow, chain, ctx, steady_steps, fork=case["fork"], state_mode=case["state_mode"]
                )
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
            event(
                f"registered ({len(managers)} group(s), {'fork' if registration.forked else 'zero-fill'}, "
                f"state {registration.state_mode})"
            )
            _check_registered(kvm, chain, shadow, registration, chain_tables)
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
