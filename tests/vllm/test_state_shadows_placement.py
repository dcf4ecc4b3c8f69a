"""Recurrent-state hand-off to shadows on the real align-mode MambaManager, next to a real
attention manager: placement of the chain's state, blanks and scratch; refusals of a chain
whose state slot cannot be established, or of a mode or layout that cannot be used, and the
unwinding after them; the pool's shortfall; the whole lifecycle back to baseline; the slot a
shadow's state is noted as come from. The mode table, the stamps and the hashing through the
real schedulers: test_state_shadows.py.

Layout unless said otherwise: attention bs 16 + align-mode state bs 64 (hash unit 16),
steady_steps 3, a 192-token chain whose state table is [null, null, S].
"""

from __future__ import annotations

import pytest
import torch
from kvwarm_testing.real_kv import in_use, make_chain, make_kv_cache_manager, make_request
from state_shadows_helpers import STOCK_028, block_ids, hybrid, no_align_bookkeeping_left, release_all
from vllm.kvwarm.kv.layout import group_layouts
from vllm.kvwarm.kv.shadows import ShadowRegistrationError, register_shadow, release_fork_retentions
from vllm.kvwarm.kv.state_mode import StateBuild, resolve_state_mode
from vllm.kvwarm.record import vocabulary
from vllm.kvwarm.record.vocabulary import COPY, INPLACE


def test_state_shadow_in_place_puts_the_chain_state_at_the_read_slot():
    kvm, attention, state = hybrid()
    chain = make_chain(kvm, "chain", 192)
    chain_attention, (null, _, chain_state) = block_ids(attention.req_to_blocks["chain"]), state.req_to_blocks["chain"]
    shadow = make_request("shadow", 101)

    registration = register_shadow(kvm, shadow, chain, ctx=100, steady_steps=3, state_mode=INPLACE)

    assert registration.state_mode == INPLACE
    assert block_ids(attention.req_to_blocks["shadow"])[:6] == chain_attention[:6]
    assert state.req_to_blocks["shadow"] == [null, chain_state]
    assert chain_state.ref_cnt == 2  # the chain's and the shadow's: both write it
    assert (state.num_cached_block["shadow"], attention.num_cached_block["shadow"]) == (2, 6)
    assert registration.groups[1].state_slot == 1 and registration.groups[1].forks == []
    release_all(kvm, shadow, chain)


def test_state_shadow_copy_forks_the_chain_state_like_an_attention_tail():
    kvm, attention, state = hybrid()
    chain = make_chain(kvm, "chain", 192)
    chain_tail, chain_state = attention.req_to_blocks["chain"][6], state.req_to_blocks["chain"][2]
    shadow = make_request("shadow", 101)

    registration = register_shadow(kvm, shadow, chain, ctx=100, steady_steps=3, state_mode=COPY)

    attention_copy = attention.req_to_blocks["shadow"][6]
    state_copy = state.req_to_blocks["shadow"][1]
    assert release_fork_retentions(kvm) == [
        (chain_tail.block_id, attention_copy.block_id),
        (chain_state.block_id, state_copy.block_id),
    ]
    assert [pair for t in registration.groups for pair in t.forks] == [
        (chain_tail.block_id, attention_copy.block_id),
        (chain_state.block_id, state_copy.block_id),
    ]
    assert (chain_state.ref_cnt, state_copy.ref_cnt) == (1, 1)
    assert (chain_tail.ref_cnt, attention_copy.ref_cnt) == (1, 1)
    release_all(kvm, shadow, chain)


@pytest.mark.parametrize(
    "ctx, expected",
    [(126, "null S blank"), (128, "null S blank"), (64, "S blank"), (100, "null S"), (150, "null null S")],
)
def test_state_shadow_pre_places_a_blank_block_at_the_crossing(ctx, expected):
    kvm, _, state = hybrid()
    chain = make_chain(kvm, "chain", 192)
    chain_state = state.req_to_blocks["chain"][2]
    shadow = make_request("shadow", ctx + 1)
    registration = register_shadow(kvm, shadow, chain, ctx=ctx, steady_steps=3, state_mode=INPLACE)

    table = state.req_to_blocks["shadow"]
    blanks = registration.groups[1].blanks
    names = ["null" if b.is_null else "S" if b is chain_state else "blank" for b in table]
    assert " ".join(names) == expected
    assert block_ids(b for b in table if not b.is_null and b is not chain_state) == blanks
    assert state.num_cached_block["shadow"] == len(table)
    release_all(kvm, shadow, chain)


def test_state_shadow_keeps_the_speculative_scratch_after_the_state():
    kvm, _, state = hybrid(speculative=1)
    chain = make_chain(kvm, "chain", 192)
    null, _, chain_state, chain_scratch = state.req_to_blocks["chain"]
    shadow = make_request("shadow", 101)
    registration = register_shadow(kvm, shadow, chain, ctx=100, steady_steps=3, state_mode=COPY)

    fork_, scratch = state.req_to_blocks["shadow"][1:]
    assert state.req_to_blocks["shadow"][0] is null
    assert registration.groups[1].forks == [(chain_state.block_id, fork_.block_id)]
    assert registration.groups[1].blanks == [scratch.block_id] and scratch is not chain_scratch
    release_all(kvm, shadow, chain)


def test_state_shadow_reads_the_state_slot_from_the_chain_depth():
    """A chain that crossed into a new state slot still lists its old state block (and
    last_state_block_idx names that old slot) until its next allocation."""
    kvm, _, state = hybrid()
    chain = make_chain(kvm, "chain", 128)
    old_state = state.req_to_blocks["chain"][1]
    assert kvm.allocate_slots(chain, 1) is not None  # decode position 128: slot 2
    chain.num_computed_tokens = 129
    new_state = state.req_to_blocks["chain"][2]
    assert state.req_to_blocks["chain"][1] is old_state and new_state is not old_state

    shadow = make_request("shadow", 101)
    register_shadow(kvm, shadow, chain, ctx=100, steady_steps=3, state_mode=INPLACE)
    assert state.req_to_blocks["shadow"][1] is new_state
    release_all(kvm, shadow, chain)


def test_state_shadow_refuses_a_chain_without_a_state_block():
    kvm, _, _state = hybrid()
    chain = make_chain(kvm, "chain", 192)
    chain.num_computed_tokens = 100  # claims a depth whose slot is null in its table
    shadow = make_request("shadow", 51)
    baseline = in_use(kvm.block_pool)
    with pytest.raises(ShadowRegistrationError, match="holds no recurrent state block at slot 1") as err:
        register_shadow(kvm, shadow, chain, ctx=50, steady_steps=3, state_mode=INPLACE)
    assert err.value.reason == vocabulary.STATE_MISSING
    assert in_use(kvm.block_pool) == baseline
    chain.num_computed_tokens = 192
    release_all(kvm, chain)


def _refused_as_state_missing(kvm, chain, mode, message):
    """A shadow at ctx 100 of `chain` is refused with state_missing and takes nothing."""
    baseline = in_use(kvm.block_pool)
    with pytest.raises(ShadowRegistrationError, match=message) as err:
        register_shadow(kvm, make_request("shadow", 101), chain, ctx=100, steady_steps=3, state_mode=mode)
    assert err.value.reason == vocabulary.STATE_MISSING
    assert in_use(kvm.block_pool) == baseline
    assert all("shadow" not in m.req_to_blocks for m in kvm.coordinator.single_type_managers)
    release_all(kvm, chain)


def test_state_shadow_refuses_a_table_short_of_its_speculative_scratch():
    kvm, _, state = hybrid(speculative=1)
    chain = make_chain(kvm, "chain", 192)  # [null, null, S, scratch]
    kvm.block_pool.free_blocks([state.req_to_blocks["chain"].pop()])  # the scratch, dropped by hand
    _refused_as_state_missing(
        kvm,
        chain,
        INPLACE,
        r"its table ends at slot 2, short of its state slot 2 "
        r"plus 1 speculative block\(s\)",
    )


@pytest.mark.parametrize("speculative", [0, 1])
def test_state_shadow_refuses_a_table_that_runs_past_its_state_and_scratch(speculative):
    """vLLM sizes an align-mode table for every scheduled token, drafts included, and keeps
    the running state at its last 1 + speculative blocks: a chain whose scheduled tokens
    were not all computed (rejected drafts) may hold its live state past the slot its depth
    names. Refused with or without speculative blocks."""
    kvm, _, state = hybrid(speculative=speculative)
    chain = make_chain(kvm, "chain", 192)
    assert kvm.allocate_slots(chain, 2) is not None  # scheduled into slot 3, nothing computed
    assert len(state.req_to_blocks["chain"]) == 4 + speculative
    _refused_as_state_missing(
        kvm,
        chain,
        COPY,
        rf"its table runs 1 block\(s\) past its state slot 2 plus "
        rf"{speculative} speculative block\(s\)",
    )


@pytest.mark.parametrize(
    "mode, detail",
    [
        (None, "not copy or inplace"),
        ("auto", "not copy or inplace"),
        ("Copy", "not copy or inplace"),
        ("copy-without-cow", "copy mode needs state managers that can fork"),
        ("inplace-where-partial-tails-are-hashed", "never hash a borrowed request's partial tail"),
    ],
)
def test_state_shadow_rejects_an_unusable_mode_and_unwinds(monkeypatch, mode, detail):
    from vllm.kvwarm.kv import shadows

    kvm, attention, state = hybrid()
    chain = make_chain(kvm, "chain", 192)
    if mode == "copy-without-cow":
        monkeypatch.setattr(state, "_apply_cow", None)  # a state manager that cannot fork
        mode = COPY
    elif (
        mode == "inplace-where-partial-tails-are-hashed"
    ):  # what the probe says on a stock build that hashes partial tails
        monkeypatch.setattr(shadows, "probe_state_build", lambda *a: STOCK_028)
        mode = INPLACE
    baseline = in_use(kvm.block_pool)
    shadow = make_request("shadow", 101)
    with pytest.raises(ShadowRegistrationError, match=detail) as err:
        register_shadow(kvm, shadow, chain, ctx=100, steady_steps=3, state_mode=mode)
    assert err.value.reason == vocabulary.STATE_MODE_UNUSABLE
    assert in_use(kvm.block_pool) == baseline and "shadow" not in attention.req_to_blocks
    monkeypatch.undo()
    release_all(kvm, chain)


def test_state_shadow_unwinds_the_attention_group_when_the_state_fork_fails(monkeypatch):
    kvm, attention, state = hybrid()
    chain = make_chain(kvm, "chain", 192)
    baseline = in_use(kvm.block_pool)
    monkeypatch.setattr(state, "_apply_cow", lambda *a: (_ for _ in ()).throw(AssertionError("injected")))
    shadow = make_request("shadow", 101)
    with pytest.raises(AssertionError, match="injected"):
        register_shadow(kvm, shadow, chain, ctx=100, steady_steps=3, state_mode=COPY)
    monkeypatch.undo()
    assert in_use(kvm.block_pool) == baseline
    assert attention.take_pending_cow_copies() == [] and state.take_pending_cow_copies() == []
    no_align_bookkeeping_left(state, "shadow")
    assert "shadow" not in attention.req_to_blocks and not shadow.borrowed_kv
    release_all(kvm, chain)


def test_state_groups_are_keyed_on_the_cache_mode_not_the_class_name():
    from vllm.kvwarm.kv.layout import STATE_ALIGN, STATE_OTHER, classify_spec
    from vllm.v1.kv_cache_interface import MambaSpec

    class LinearAttentionStateSpec(MambaSpec):  # another name, the same cache modes
        pass

    def spec(mode):
        return LinearAttentionStateSpec(block_size=64, shapes=((2,),), dtypes=(torch.float32,), mamba_cache_mode=mode)

    assert (classify_spec(spec("align"))[0], classify_spec(spec("none"))[0]) == (STATE_ALIGN, STATE_OTHER)


def _non_align_hybrid():
    """A hybrid whose Mamba group is not in align mode, with prefix caching where the build
    allows that, else without (builds that assert Mamba prefix caching needs align mode)."""
    try:
        return hybrid(mode="none")
    except AssertionError as err:
        if "align" not in str(err):
            raise
        kvm = make_kv_cache_manager([16], state_groups=[(64, 0, "none")], enable_caching=False)
        return (kvm, *kvm.coordinator.single_type_managers)


def test_state_shadow_rejects_a_non_align_mamba_group():
    kvm, _, _ = _non_align_hybrid()
    layouts = group_layouts(kvm)
    assert (
        resolve_state_mode(layouts, StateBuild(True, True), None).reason == vocabulary.HYBRID_STATE_LAYERS_UNSUPPORTED
    )
    shadow = make_request("shadow", 101)
    with pytest.raises(ShadowRegistrationError) as err:
        register_shadow(kvm, shadow, make_request("chain", 1), ctx=100, steady_steps=3, state_mode=COPY)
    assert err.value.reason == vocabulary.LAYOUT_UNSUPPORTED and "state_other" in str(err.value)


@pytest.mark.parametrize("mode", [COPY, INPLACE])
def test_shadow_pool_shortfall_adds_the_state_group_blocks(mode):
    # ctx 126, steady_steps 3: attention 2 blocks; state (1 fork in copy mode) + 1 blank.
    kvm, _, _ = hybrid(num_blocks=40)
    chain = make_chain(kvm, "chain", 192)  # 12 + 1 blocks
    need = 2 + (mode == COPY) + 1
    pool = kvm.block_pool
    spare = pool.get_new_blocks(pool.get_num_free_blocks() - need + 1)
    shadow = make_request("shadow", 127)
    with pytest.raises(ShadowRegistrationError, match="1 more free block") as err:
        register_shadow(kvm, shadow, chain, ctx=126, steady_steps=3, state_mode=mode)
    assert err.value.reason == vocabulary.POOL_EXHAUSTED
    pool.free_blocks(spare[:1])
    register_shadow(kvm, shadow, chain, ctx=126, steady_steps=3, state_mode=mode)
    assert pool.get_num_free_blocks() == 0
    pool.free_blocks(spare[1:])
    release_all(kvm, shadow, chain)


@pytest.mark.parametrize("fork", [True, False])
@pytest.mark.parametrize("mode", [COPY, INPLACE])
def test_state_shadow_lifecycle_returns_every_reference(mode, fork):
    kvm, _attention, state = hybrid(num_blocks=128, speculative=1)
    chains = [make_chain(kvm, f"chain{i}", 192 + 40 * i) for i in range(2)]
    baseline = in_use(kvm.block_pool)
    shadows = []
    for i, ctx in enumerate([63, 64, 65, 126, 128, 191]):
        shadow = make_request(f"shadow{i}", ctx + 1)
        register_shadow(kvm, shadow, chains[i % 2], ctx=ctx, steady_steps=3, fork=fork, state_mode=mode)
        shadows.append(shadow)
    release_fork_retentions(kvm)
    for shadow in shadows:
        kvm.free(shadow)
        no_align_bookkeeping_left(state, shadow.request_id)
    assert in_use(kvm.block_pool) == baseline
    release_all(kvm, *chains)


@pytest.mark.parametrize("mode", [COPY, INPLACE])
@pytest.mark.parametrize("ctx, noted", [(150, 1), (100, 0), (60, None)])
def test_a_shadow_is_noted_as_come_from_the_slot_below(mode, ctx, noted):
    """The manager notes the slot below the read slot as the one the shadow's state left
    (none below slot 0); that slot is null in the shadow's table, and unwinding forgets it."""
    kvm, _, state = hybrid()
    chain = make_chain(kvm, "chain", 192)
    shadow = make_request("shadow", ctx + 1)
    register_shadow(kvm, shadow, chain, ctx=ctx, steady_steps=3, state_mode=mode)
    assert state.last_state_block_idx.get("shadow") == noted
    if noted is not None:
        assert state.req_to_blocks["shadow"][noted].is_null
    release_all(kvm, shadow, chain)
    no_align_bookkeeping_left(state, "shadow")
