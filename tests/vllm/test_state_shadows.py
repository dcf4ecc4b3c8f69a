"""Recurrent-state hand-off to shadows on the real align-mode MambaManager, next to a real
attention manager (placement of the chain's state, blanks and scratch; refusals of a chain
whose state slot cannot be established; the gate's state reasons, the mode table per
build, stamps).

Layout unless said otherwise: attention bs 16 + align-mode state bs 64 (hash unit 16),
steady_steps 3, a 192-token chain whose state table is [null, null, S].
"""

from __future__ import annotations

import pytest
import torch
from kvwarm_testing.real_kv import (
    in_use,
    make_chain,
    make_kv_cache_manager,
    make_request,
    make_scheduler,
    park,
    runner_output,
    step_scheduler,
)
from vllm.kvwarm.kv import state_mode
from vllm.kvwarm.kv.layout import group_layouts
from vllm.kvwarm.kv.shadows import ShadowRegistrationError, register_shadow, release_fork_retentions
from vllm.kvwarm.kv.state_mode import StateBuild, decide_state_mode, resolve_state_mode
from vllm.kvwarm.record import vocabulary
from vllm.kvwarm.record.vocabulary import COPY, EXACT, INPLACE, state_stamps


def _hybrid(num_blocks=64, speculative=0, mode="align"):
    kvm = make_kv_cache_manager([16], num_blocks=num_blocks, state_groups=[(64, speculative, mode)])
    attention, state = kvm.coordinator.single_type_managers
    return kvm, attention, state


def _ids(blocks):
    return [b.block_id for b in blocks]


def _release_all(kvm, *requests):
    release_fork_retentions(kvm)
    for request in requests:
        kvm.free(request)
    pool = kvm.block_pool
    assert in_use(pool) == {}
    assert pool.null_block not in pool.free_block_queue.get_all_free_blocks()
    assert pool.reset_prefix_cache()


def _no_align_bookkeeping_left(manager, request_id):
    for name in ("req_to_blocks", "num_cached_block", "last_state_block_idx", "_allocated_block_reqs"):
        assert request_id not in getattr(manager, name, ()), name


def test_state_shadow_in_place_puts_the_chain_state_at_the_read_slot():
    kvm, attention, state = _hybrid()
    chain = make_chain(kvm, "chain", 192)
    chain_attention, (null, _, chain_state) = _ids(attention.req_to_blocks["chain"]), state.req_to_blocks["chain"]
    shadow = make_request("shadow", 101)

    registration = register_shadow(kvm, shadow, chain, ctx=100, steady_steps=3, state_mode=INPLACE)

    assert registration.state_mode == INPLACE
    assert _ids(attention.req_to_blocks["shadow"])[:6] == chain_attention[:6]
    assert state.req_to_blocks["shadow"] == [null, chain_state]
    assert chain_state.ref_cnt == 2  # the chain's and the shadow's: both write it
    assert (state.num_cached_block["shadow"], attention.num_cached_block["shadow"]) == (2, 6)
    assert registration.groups[1].state_slot == 1 and registration.groups[1].forks == []
    _release_all(kvm, shadow, chain)


def test_state_shadow_copy_forks_the_chain_state_like_an_attention_tail():
    kvm, attention, state = _hybrid()
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
    _release_all(kvm, shadow, chain)


@pytest.mark.parametrize(
    "ctx, expected",
    [(126, "null S blank"), (128, "null S blank"), (64, "S blank"), (100, "null S"), (150, "null null S")],
)
def test_state_shadow_pre_places_a_blank_block_at_the_crossing(ctx, expected):
    kvm, _, state = _hybrid()
    chain = make_chain(kvm, "chain", 192)
    chain_state = state.req_to_blocks["chain"][2]
    shadow = make_request("shadow", ctx + 1)
    registration = register_shadow(kvm, shadow, chain, ctx=ctx, steady_steps=3, state_mode=INPLACE)

    table = state.req_to_blocks["shadow"]
    blanks = registration.groups[1].blanks
    names = ["null" if b.is_null else "S" if b is chain_state else "blank" for b in table]
    assert " ".join(names) == expected
    assert _ids(b for b in table if not b.is_null and b is not chain_state) == blanks
    assert state.num_cached_block["shadow"] == len(table)
    _release_all(kvm, shadow, chain)


def test_state_shadow_keeps_the_speculative_scratch_after_the_state():
    kvm, _, state = _hybrid(speculative=1)
    chain = make_chain(kvm, "chain", 192)
    null, _, chain_state, chain_scratch = state.req_to_blocks["chain"]
    shadow = make_request("shadow", 101)
    registration = register_shadow(kvm, shadow, chain, ctx=100, steady_steps=3, state_mode=COPY)

    fork_, scratch = state.req_to_blocks["shadow"][1:]
    assert state.req_to_blocks["shadow"][0] is null
    assert registration.groups[1].forks == [(chain_state.block_id, fork_.block_id)]
    assert registration.groups[1].blanks == [scratch.block_id] and scratch is not chain_scratch
    _release_all(kvm, shadow, chain)


def test_state_shadow_reads_the_state_slot_from_the_chain_depth():
    """A chain that crossed into a new state slot still lists its old state block (and
    last_state_block_idx names that old slot) until its next allocation."""
    kvm, _, state = _hybrid()
    chain = make_chain(kvm, "chain", 128)
    old_state = state.req_to_blocks["chain"][1]
    assert kvm.allocate_slots(chain, 1) is not None  # decode position 128: slot 2
    chain.num_computed_tokens = 129
    new_state = state.req_to_blocks["chain"][2]
    assert state.req_to_blocks["chain"][1] is old_state and new_state is not old_state

    shadow = make_request("shadow", 101)
    register_shadow(kvm, shadow, chain, ctx=100, steady_steps=3, state_mode=INPLACE)
    assert state.req_to_blocks["shadow"][1] is new_state
    _release_all(kvm, shadow, chain)


def test_state_shadow_refuses_a_chain_without_a_state_block():
    kvm, _, _state = _hybrid()
    chain = make_chain(kvm, "chain", 192)
    chain.num_computed_tokens = 100  # claims a depth whose slot is null in its table
    shadow = make_request("shadow", 51)
    baseline = in_use(kvm.block_pool)
    with pytest.raises(ShadowRegistrationError, match="holds no recurrent state block at slot 1") as err:
        register_shadow(kvm, shadow, chain, ctx=50, steady_steps=3, state_mode=INPLACE)
    assert err.value.reason == vocabulary.STATE_MISSING
    assert in_use(kvm.block_pool) == baseline
    chain.num_computed_tokens = 192
    _release_all(kvm, chain)


def _refused_as_state_missing(kvm, chain, mode, message):
    """A shadow at ctx 100 of `chain` is refused with state_missing and takes nothing."""
    baseline = in_use(kvm.block_pool)
    with pytest.raises(ShadowRegistrationError, match=message) as err:
        register_shadow(kvm, make_request("shadow", 101), chain, ctx=100, steady_steps=3, state_mode=mode)
    assert err.value.reason == vocabulary.STATE_MISSING
    assert in_use(kvm.block_pool) == baseline
    assert all("shadow" not in m.req_to_blocks for m in kvm.coordinator.single_type_managers)
    _release_all(kvm, chain)


def test_state_shadow_refuses_a_table_short_of_its_speculative_scratch():
    kvm, _, state = _hybrid(speculative=1)
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
    kvm, _, state = _hybrid(speculative=speculative)
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

    kvm, attention, state = _hybrid()
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
    _release_all(kvm, chain)


def test_state_shadow_unwinds_the_attention_group_when_the_state_fork_fails(monkeypatch):
    kvm, attention, state = _hybrid()
    chain = make_chain(kvm, "chain", 192)
    baseline = in_use(kvm.block_pool)
    monkeypatch.setattr(state, "_apply_cow", lambda *a: (_ for _ in ()).throw(AssertionError("injected")))
    shadow = make_request("shadow", 101)
    with pytest.raises(AssertionError, match="injected"):
        register_shadow(kvm, shadow, chain, ctx=100, steady_steps=3, state_mode=COPY)
    monkeypatch.undo()
    assert in_use(kvm.block_pool) == baseline
    assert attention.take_pending_cow_copies() == [] and state.take_pending_cow_copies() == []
    _no_align_bookkeeping_left(state, "shadow")
    assert "shadow" not in attention.req_to_blocks and not shadow.borrowed_kv
    _release_all(kvm, chain)


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
        return _hybrid(mode="none")
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
    kvm, _, _ = _hybrid(num_blocks=40)
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
    _release_all(kvm, shadow, chain)


@pytest.mark.parametrize("fork", [True, False])
@pytest.mark.parametrize("mode", [COPY, INPLACE])
def test_state_shadow_lifecycle_returns_every_reference(mode, fork):
    kvm, _attention, state = _hybrid(num_blocks=128, speculative=1)
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
        _no_align_bookkeeping_left(state, shadow.request_id)
    assert in_use(kvm.block_pool) == baseline
    _release_all(kvm, *chains)


# The build profiles the mode table is about: what each build's state managers can do.
STOCK_025 = StateBuild(can_fork=False, inplace_ok=True)  # no CoW; no partial-tail hashing
PATCHED_025 = StateBuild(can_fork=True, inplace_ok=True)  # CoW backport
STOCK_028 = StateBuild(can_fork=True, inplace_ok=False)  # hashes partial tails of borrowers
PATCHED_028 = StateBuild(can_fork=True, inplace_ok=True)  # borrowed_kv exemption


@pytest.mark.parametrize(
    "build, requested, mode, reason",
    [
        (STOCK_025, None, EXACT, None),
        (STOCK_025, "copy", None, vocabulary.STATE_COPY_UNSUPPORTED),
        (STOCK_025, "inplace", INPLACE, None),
        (PATCHED_025, None, EXACT, None),
        (PATCHED_025, "COPY", COPY, None),
        (PATCHED_025, " InPlace ", None, vocabulary.STATE_INPLACE_UNFAITHFUL),
        (STOCK_028, "auto", EXACT, None),
        (STOCK_028, "copy", COPY, None),
        (STOCK_028, "inplace", None, vocabulary.STATE_INPLACE_UNSUPPORTED),
        (PATCHED_028, "auto", EXACT, None),
        (PATCHED_028, "inplace", None, vocabulary.STATE_INPLACE_UNFAITHFUL),
        (StateBuild(can_fork=False, inplace_ok=False), "inplace", None, vocabulary.STATE_INPLACE_UNSUPPORTED),
        (StateBuild(can_fork=False, inplace_ok=False), "auto", None, vocabulary.STATE_HAND_OFF_UNSUPPORTED),
        (PATCHED_028, "fork", None, vocabulary.STATE_MODE_INVALID),
        (PATCHED_028, "exact", EXACT, None),
        (STOCK_025, "Exact", EXACT, None),
        (STOCK_028, "exact", EXACT, None),
        (StateBuild(can_fork=False, inplace_ok=False), "exact", None, vocabulary.STATE_EXACT_UNSUPPORTED),
    ],
)
def test_state_mode_resolution(build, requested, mode, reason):
    layouts = group_layouts(_hybrid()[0])
    decision = resolve_state_mode(layouts, build, requested)
    assert (decision.mode, decision.reason, decision.requested) == (mode, reason, requested)


@pytest.mark.parametrize(
    "build, lending",
    [(PATCHED_028, COPY), (STOCK_025, INPLACE), (STOCK_028, COPY), (StateBuild(False, False), None)],
)
def test_exact_mode_lends_catch_ups_by_copy_where_the_build_forks_else_in_place(build, lending):
    decision = resolve_state_mode(group_layouts(_hybrid()[0]), build, "exact")
    assert decision.lending == lending


def test_this_build_probes_as_a_patched_build(monkeypatch):
    kvm, _, _ = _hybrid()
    assert state_mode.probe_state_build(group_layouts(kvm), kvm) == PATCHED_028 == PATCHED_025
    monkeypatch.delenv(state_mode.STATE_ENV, raising=False)
    assert decide_state_mode(kvm, group_layouts(kvm), {}).mode == EXACT
    refused = decide_state_mode(kvm, group_layouts(kvm), {state_mode.STATE_ENV: "inplace"})
    assert (refused.mode, refused.reason) == (None, vocabulary.STATE_INPLACE_UNFAITHFUL)
    assert state_mode.refusal_hint(refused.reason).startswith(f"set {state_mode.STATE_ENV} to copy")
    assert state_mode.refusal_hint(vocabulary.STATE_HAND_OFF_UNSUPPORTED) is None  # nothing to set


def test_the_state_mode_is_validated_only_where_it_matters():
    kvm = make_kv_cache_manager([16, 32])
    decision = resolve_state_mode(group_layouts(kvm), PATCHED_028, "nonsense")
    assert (decision.mode, decision.reason, decision.requested) == (None, None, "nonsense")


def test_stamps_and_metadata_are_the_same_whatever_the_free_pool():
    environ = {state_mode.STATE_ENV: "Auto"}
    decisions = []
    for num_blocks in (16, 400):
        kvm, _, _ = _hybrid(num_blocks=num_blocks)
        kvm.block_pool.get_new_blocks(kvm.block_pool.get_num_free_blocks() - 1)  # nearly empty
        decisions.append(decide_state_mode(kvm, group_layouts(kvm), environ))
    assert decisions[0] == decisions[1]
    assert decisions[0].metadata() == {"state_mode_requested": "Auto", "state_mode": EXACT}
    assert state_stamps(decisions[0].mode, 192) == ["kvwarm_state_exact", "kvwarm_state_depth=192"]
    assert state_stamps(None, 192) == []  # pure-attention points carry no state stamp


def _parked_chain(scheduler, tokens: int = 192):
    """A chain prefilled through `scheduler` (hash unit 16), then parked: resident, no
    longer scheduled."""
    chain = make_request("chain", tokens, hash_block_size=16)
    chain.max_tokens = chain.sampling_params.max_tokens = 1000
    park(scheduler, [chain])
    return chain


def _admit_one_short(scheduler, shadow, ctx: int, running: bool = True) -> None:
    """A registered shadow admitted as the injector admits it: ctx tokens computed, one
    short of its prompt; `running`: scheduled by the stock loop from the next step."""
    from vllm.v1.request import RequestStatus

    shadow.num_computed_tokens, shadow.status = ctx, RequestStatus.RUNNING
    scheduler.requests[shadow.request_id] = shadow
    if running:
        scheduler.running.append(shadow)


def _in_place_steady_steps(tmp_path, borrowed_kv: bool, stock_loop: bool, steps: int = 20):
    """Through the real AsyncScheduler: a 192-token chain prefilled and parked, then an
    in-place shadow at ctx 111 on a layout whose state block (64) is larger than the
    prefix-match unit (16), for `steps` steady steps. `stock_loop`: the steps go through
    schedule() (allocate_slots included), as with this project's adapter; otherwise they
    are made by hand and fed to update_from_output, as the original harness made them.
    Yields (computed tokens, the shadow's cached state count, the chain's state key still
    on its block, the ids of every block carrying that key)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.output import SchedulerOutput

    scheduler = make_scheduler(
        tmp_path, block_size=64, hash_block_size=16, state_block_size=64, scheduler_cls=AsyncScheduler
    )
    kvm = scheduler.kv_cache_manager
    _, state = kvm.coordinator.single_type_managers
    chain = _parked_chain(scheduler)
    chain_state = state.req_to_blocks["chain"][2]
    chain_key = chain_state.block_hash
    assert chain_key is not None  # the chain's full-block key on its state block

    shadow = make_request("shadow", 112, hash_block_size=16)  # the chain's own tokens
    shadow.max_tokens = shadow.sampling_params.max_tokens = steps + 5
    register_shadow(kvm, shadow, chain, ctx=111, steady_steps=steps, state_mode=INPLACE)
    release_fork_retentions(kvm)
    shadow.borrowed_kv = borrowed_kv  # False: what a build without the exemption does
    _admit_one_short(scheduler, shadow, 111, running=stock_loop)
    for _ in range(steps):
        if stock_loop:
            step_scheduler(scheduler)
        else:
            output = SchedulerOutput.make_empty()
            output.num_scheduled_tokens["shadow"], output.total_num_scheduled_tokens = 1, 1
            scheduler._update_after_schedule(output)
            scheduler.update_from_output(output, runner_output(["shadow"], [[7]]))
        holders = [b.block_id for b in kvm.block_pool.blocks if b.block_hash == chain_key]
        yield (
            shadow.num_computed_tokens,
            state.num_cached_block["shadow"],
            chain_state.block_hash == chain_key,
            holders,
        )


def _partial_tail_damage_missing(tmp_path) -> str | None:
    """Why this build shows no partial-tail damage to reproduce, or None where it does: the
    first steady step of a shadow without the exemption drops its cached state count."""
    from vllm.kvwarm.kv.capabilities import hashes_partial_tails
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    if not hashes_partial_tails(MambaManager):
        return "this build never hashes partial state tails"
    tokens, cached, _, _ = next(_in_place_steady_steps(tmp_path / "probe", borrowed_kv=False, stock_loop=False))
    if cached != 1:
        return (
            f"this build hashes partial state tails but leaves a state block already keyed at "
            f"the boundary alone (cached count {cached} at {tokens} tokens)"
        )
    return None


def test_partial_tail_hashing_ends_in_the_promotion_assertion_without_the_exemption(tmp_path):
    """A stock build's failure where partial tails are hashed, on the real classes: at the shadow's
    prompt boundary (112 tokens) `_cache_partial_tail_block` stacks the shadow's partial
    key on the chain's state block and drops the shadow's cached count 3 -> 1; at 128 the
    promotion assertion of `BlockPool.cache_full_blocks` fires."""
    if (missing := _partial_tail_damage_missing(tmp_path)) is not None:
        pytest.skip(f"{missing}, so there is nothing to reproduce")
    steps = _in_place_steady_steps(tmp_path, borrowed_kv=False, stock_loop=False)
    assert next(steps)[:3] == (112, 1, True)
    completed = []
    with pytest.raises(AssertionError) as err:
        for tokens, _, _, _ in steps:
            completed.append(tokens)
    assert completed[-1] == 127  # the step that computes position 127 (reaching 128) fails
    assert any(entry.name == "cache_full_blocks" for entry in err.traceback)


def test_through_the_stock_loop_the_chain_loses_its_key_without_the_exemption(tmp_path):
    """The same shadow stepped through schedule(), as this project's adapter does: the
    manager's producer fork then moves the chain's own key onto a fresh block filled from
    the state the in-place shadow is advancing, so the chain's prefix-cache entry names a
    block of the shadow's making."""
    if (missing := _partial_tail_damage_missing(tmp_path)) is not None:
        pytest.skip(f"{missing}, so there is nothing to reproduce")
    history = list(_in_place_steady_steps(tmp_path, borrowed_kv=False, stock_loop=True))
    (tokens, cached, kept, _), after = history[0], history[1]
    assert (tokens, cached, kept) == (112, 1, True)
    if after[2]:
        pytest.skip("this build's stock loop forks no partial tail at this step: the chain keeps its key")
    assert len(after[3]) == 1  # the key now lives on another block


@pytest.mark.parametrize("stock_loop", [False, True], ids=["harness", "stock-loop"])
def test_borrowed_shadows_leave_the_chain_state_alone(tmp_path, stock_loop):
    """Both sequences with the hook's exemption (every kvwarm build): nothing is hashed for
    the shadow, the cached count stays pinned and the chain's key stays on the chain's
    block alone, past the 128 crossing."""
    history = list(_in_place_steady_steps(tmp_path, borrowed_kv=True, stock_loop=stock_loop))
    assert [step[:3] for step in history] == [(112 + i, 3, True) for i in range(20)]
    assert all(len(step[3]) == 1 for step in history)


@pytest.mark.parametrize("scheduler_kind", ["sync", "async"])
def test_a_copy_shadow_with_keys_of_its_own_is_hashed_and_leaves_the_chain_alone(tmp_path, scheduler_kind):
    """A shadow as the injector builds it (a block hasher under its own salt), lent the state
    by copy, stepped through schedule() past the 128 crossing on a layout whose state block
    is larger than the hash unit: it is hashed like any request (its own blocks get keys),
    the chain's blocks keep their keys, no other block takes one of them, and every
    reference comes back."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    scheduler = make_scheduler(
        tmp_path,
        block_size=64,
        hash_block_size=16,
        state_block_size=64,
        scheduler_cls=AsyncScheduler if scheduler_kind == "async" else Scheduler,
    )
    kvm = scheduler.kv_cache_manager
    chain = _parked_chain(scheduler)
    chain_blocks = [b for m in kvm.coordinator.single_type_managers for b in m.req_to_blocks["chain"]]
    chain_keys = {b.block_id: b.block_hash for b in chain_blocks if b.block_hash is not None}
    assert chain_keys

    steps = 40
    shadow = make_request("shadow", 112, hash_block_size=16, cache_salt="shadow")  # the chain's tokens
    shadow.max_tokens = shadow.sampling_params.max_tokens = steps
    register_shadow(kvm, shadow, chain, ctx=111, steady_steps=steps, state_mode=COPY, own_keys=True)
    assert not shadow.borrowed_kv
    release_fork_retentions(kvm)
    _admit_one_short(scheduler, shadow, 111)
    keyed = set()
    while "shadow" in scheduler.requests:
        own = [b for m in kvm.coordinator.single_type_managers for b in m.req_to_blocks.get("shadow", [])]
        keyed |= {b.block_id for b in own if b.block_hash is not None and b.block_id not in chain_keys}
        step_scheduler(scheduler)
        assert {b.block_id: b.block_hash for b in chain_blocks if b.block_hash is not None} == chain_keys
        holders = [b.block_id for b in kvm.block_pool.blocks if b.block_hash in chain_keys.values()]
        assert sorted(holders) == sorted(chain_keys)
    assert keyed  # the blocks it filled itself were cached, as a natural request's are
    assert len(shadow.output_token_ids) == steps
    _release_all(kvm, chain)


def test_an_in_place_shadow_is_never_hashed_even_with_keys_of_its_own():
    """In place the shadow's state block is the chain's: own_keys changes nothing there."""
    kvm, _, _ = _hybrid()
    chain = make_chain(kvm, "chain", 192)
    shadow = make_request("shadow", 101)
    register_shadow(kvm, shadow, chain, ctx=100, steady_steps=3, state_mode=INPLACE, own_keys=True)
    assert shadow.borrowed_kv
    _release_all(kvm, shadow, chain)


@pytest.mark.parametrize("mode", [COPY, INPLACE])
@pytest.mark.parametrize("ctx, noted", [(150, 1), (100, 0), (60, None)])
def test_a_shadow_is_noted_as_come_from_the_slot_below(mode, ctx, noted):
    """The manager notes the slot below the read slot as the one the shadow's state left
    (none below slot 0); that slot is null in the shadow's table, and unwinding forgets it."""
    kvm, _, state = _hybrid()
    chain = make_chain(kvm, "chain", 192)
    shadow = make_request("shadow", ctx + 1)
    register_shadow(kvm, shadow, chain, ctx=ctx, steady_steps=3, state_mode=mode)
    assert state.last_state_block_idx.get("shadow") == noted
    if noted is not None:
        assert state.req_to_blocks["shadow"][noted].is_null
    _release_all(kvm, shadow, chain)
    _no_align_bookkeeping_left(state, "shadow")


def test_a_copy_shadow_keeps_the_state_bookkeeping_of_a_request_decoding_there(tmp_path):
    """Through the real Scheduler: a natural request prefilled to 100 tokens decodes across
    128 into state slot 2; a copy shadow at ctx 150 (read slot 2) decodes beside it. At every
    depth both have left the same slot and hold state blocks at the same slots, so each step
    does the same state bookkeeping, up to the next crossing (192), where the natural request
    allocates its next state block and the shadow's is already placed."""
    scheduler = make_scheduler(tmp_path, block_size=64, hash_block_size=16, state_block_size=64)
    kvm = scheduler.kv_cache_manager
    _, state = kvm.coordinator.single_type_managers
    chain = _parked_chain(scheduler)

    natural = make_request("natural", 100, token=9, hash_block_size=16, cache_salt="natural")
    natural.max_tokens = natural.sampling_params.max_tokens = 100
    scheduler.add_request(natural)
    shadow = make_request("shadow", 151, hash_block_size=16, cache_salt="shadow")
    shadow.max_tokens = shadow.sampling_params.max_tokens = 41  # to depth 191, within the chain's blocks
    register_shadow(kvm, shadow, chain, ctx=150, steady_steps=41, state_mode=COPY, own_keys=True)
    release_fork_retentions(kvm)
    _admit_one_short(scheduler, shadow, 150)

    def bookkeeping(request_id):
        table = state.req_to_blocks[request_id][:3]
        return state.last_state_block_idx.get(request_id), [i for i, b in enumerate(table) if not b.is_null]

    seen = {"natural": {}, "shadow": {}}
    while natural.num_computed_tokens < 191:
        step_scheduler(scheduler)
        for request in (natural, shadow):
            if request.request_id in state.req_to_blocks:
                seen[request.request_id][request.num_computed_tokens] = bookkeeping(request.request_id)
    depths = range(152, 191)
    assert [seen["shadow"][d] for d in depths] == [seen["natural"][d] for d in depths]
    assert seen["shadow"][160] == (1, [2])
