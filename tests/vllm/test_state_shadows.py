"""Recurrent-state hand-off to shadows, the mode and the hashing: the mode table per build
and the gate's state reasons, the stamps; a stock build's partial-tail damage (where it
hashes partial tails) reproduced through the real AsyncScheduler, and the exemption that
prevents it; a copy shadow hashed like any request under keys of its own, and its state
bookkeeping beside a natural request's. Placement, refusals and the lifecycle:
test_state_shadows_placement.py.

Layout unless said otherwise: attention bs 16 + align-mode state bs 64 (hash unit 16),
steady_steps 3, a 192-token chain whose state table is [null, null, S].
"""

from __future__ import annotations

import pytest
from kvwarm_testing.real_kv import (
    make_chain,
    make_kv_cache_manager,
    make_request,
    make_scheduler,
    park,
    runner_output,
    step_scheduler,
)
from state_shadows_helpers import PATCHED_025, PATCHED_028, STOCK_025, STOCK_028, hybrid, release_all
from vllm.kvwarm.kv import state_mode
from vllm.kvwarm.kv.layout import group_layouts
from vllm.kvwarm.kv.shadows import register_shadow, release_fork_retentions
from vllm.kvwarm.kv.state_mode import StateBuild, decide_state_mode, resolve_state_mode
from vllm.kvwarm.record import vocabulary
from vllm.kvwarm.record.vocabulary import COPY, EXACT, INPLACE, state_stamps


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
    layouts = group_layouts(hybrid()[0])
    decision = resolve_state_mode(layouts, build, requested)
    assert (decision.mode, decision.reason, decision.requested) == (mode, reason, requested)


@pytest.mark.parametrize(
    "build, lending",
    [(PATCHED_028, COPY), (STOCK_025, INPLACE), (STOCK_028, COPY), (StateBuild(False, False), None)],
)
def test_exact_mode_lends_catch_ups_by_copy_where_the_build_forks_else_in_place(build, lending):
    decision = resolve_state_mode(group_layouts(hybrid()[0]), build, "exact")
    assert decision.lending == lending


def test_this_build_probes_as_a_patched_build(monkeypatch):
    kvm, _, _ = hybrid()
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
        kvm, _, _ = hybrid(num_blocks=num_blocks)
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
    release_all(kvm, chain)


def test_an_in_place_shadow_is_never_hashed_even_with_keys_of_its_own():
    """In place the shadow's state block is the chain's: own_keys changes nothing there."""
    kvm, _, _ = hybrid()
    chain = make_chain(kvm, "chain", 192)
    shadow = make_request("shadow", 101)
    register_shadow(kvm, shadow, chain, ctx=100, steady_steps=3, state_mode=INPLACE, own_keys=True)
    assert shadow.borrowed_kv
    release_all(kvm, shadow, chain)


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
