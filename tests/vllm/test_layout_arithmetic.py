"""Group classification on vLLM's real spec classes (and the refusal of a spec whose kind
cannot be established), and the block arithmetic on worked examples."""

from __future__ import annotations

import pytest
import torch
from kvwarm_testing.real_kv import in_use, make_chain, make_kv_cache_manager, make_request
from vllm.kvwarm.kv import layout
from vllm.kvwarm.kv.arithmetic import (
    attention_private_blocks,
    plan_tail_blocks,
    pool_shortfall,
    shadow_private_blocks,
    state_private_blocks,
)
from vllm.kvwarm.kv.layout import ATTENTION, STATE_ALIGN, GroupLayout
from vllm.kvwarm.record import vocabulary


def _attention_spec(cls_name="FullAttentionSpec", **extra):
    from vllm.v1 import kv_cache_interface

    return getattr(kv_cache_interface, cls_name)(
        block_size=16, num_kv_heads=1, head_size=32, dtype=torch.float32, **extra
    )


def _mamba_spec(mode):
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=64, shapes=((2,),), dtypes=(torch.float32,), mamba_cache_mode=mode)


@pytest.mark.parametrize(
    "make_spec, kind",
    [
        (lambda: _attention_spec(), layout.ATTENTION),
        (lambda: _attention_spec("MLAAttentionSpec"), layout.ATTENTION),
        # The manager keeps every block of a sliding-window layer folded into full attention.
        (lambda: _attention_spec(sliding_window=128), layout.ATTENTION),
        # A reference sliding window keeps only the last rswa_window tokens' blocks.
        (lambda: _attention_spec("RSWASpec", rswa_window=64), layout.UNSUPPORTED),
        (lambda: _attention_spec("SinkFullAttentionSpec", sink_len=4), layout.ATTENTION),
        (lambda: _attention_spec("SlidingWindowSpec", sliding_window=128), layout.UNSUPPORTED),
        (lambda: _attention_spec("ChunkedLocalAttentionSpec", attention_chunk_size=64), layout.UNSUPPORTED),
        (lambda: _mamba_spec("align"), layout.STATE_ALIGN),
        (lambda: _mamba_spec("none"), layout.STATE_OTHER),
        (lambda: _mamba_spec("all"), layout.STATE_OTHER),
    ],
)
def test_groups_are_classified_by_spec_and_cache_mode(make_spec, kind):
    assert layout.classify_spec(make_spec())[0] == kind


def _full_attention_stand_in():
    """A stand-in for a full-attention spec subclass of a release that renamed the
    reference window's field (`rswa_window` -> `reference_window`): not a vLLM class."""
    import dataclasses

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class RenamedWindowSpecStandIn(FullAttentionSpec):
        reference_window: int

    return RenamedWindowSpecStandIn(
        block_size=16, num_kv_heads=1, head_size=32, dtype=torch.float32, reference_window=64
    )


def _unknown_spec_stand_in():
    """A stand-in for a spec class vLLM might add that is none of the known families."""
    import dataclasses

    from vllm.v1.kv_cache_interface import KVCacheSpec

    @dataclasses.dataclass(frozen=True)
    class UnknownSpecStandIn(KVCacheSpec):
        pass

    return UnknownSpecStandIn(block_size=16)


@pytest.mark.parametrize(
    "make_spec, detail",
    [
        (
            _full_attention_stand_in,
            (
                "RenamedWindowSpecStandIn extends full attention with field(s) reference_window "
                "that the layout does not know"
            ),
        ),
        (_unknown_spec_stand_in, "UnknownSpecStandIn is a KV-cache spec the layout does not know"),
    ],
)
def test_a_spec_of_unknown_kind_is_unknown_with_its_reason_never_attention(make_spec, detail):
    kind, why = layout.classify_spec(make_spec())
    assert kind == layout.UNKNOWN and why.startswith(detail)


def test_registration_refuses_a_group_of_unknown_kind_by_name():
    from vllm.kvwarm.kv.shadows import ShadowRegistrationError, register_shadow

    kvm = make_kv_cache_manager([16])
    chain = make_chain(kvm, "chain", 64)
    (manager,) = kvm.coordinator.single_type_managers
    manager.kv_cache_spec = _full_attention_stand_in()  # the real manager, a spec it could have
    baseline = in_use(kvm.block_pool)
    with pytest.raises(
        ShadowRegistrationError,
        match="group 0: RenamedWindowSpecStandIn extends full attention with field.s. reference_window",
    ) as err:
        register_shadow(kvm, make_request("shadow", 41), chain, ctx=40, steady_steps=3)
    assert err.value.reason == vocabulary.LAYOUT_UNKNOWN
    assert in_use(kvm.block_pool) == baseline and "shadow" not in manager.req_to_blocks


def test_group_layouts_of_a_real_manager_follow_group_order():
    kvm = make_kv_cache_manager([32, 16])
    groups = layout.group_layouts(kvm)
    assert [(g.group_id, g.kind, g.block_size) for g in groups] == [(0, ATTENTION, 32), (1, ATTENTION, 16)]
    assert all(g.can_fork for g in groups)  # both builds carry _apply_cow


def _group(kind, block_size, speculative=0):
    return GroupLayout(0, kind, block_size, speculative, manager=None)


@pytest.mark.parametrize(
    "ctx, steady_steps, block, expected",
    [
        (40, 3, 16, 1),
        (47, 3, 16, 2),
        (48, 0, 16, 1),
        (100, 3, 16, 1),
        (126, 3, 16, 2),
        (127, 0, 128, 1),
    ],
)
def test_attention_private_blocks(ctx, steady_steps, block, expected):
    assert attention_private_blocks(ctx, steady_steps, block) == expected


def test_pool_precheck_example_of_the_mechanism_notes():
    # Attention bs 16 + align state bs 64, steady_steps 3, copy mode, shadows at ctx 100 and 126.
    groups = [_group(ATTENTION, 16), _group(STATE_ALIGN, 64)]
    need = sum(shadow_private_blocks(groups, ctx, 3, state_copy=True) for ctx in (100, 126))
    assert (state_private_blocks(100, 3, 64, True, 0), state_private_blocks(126, 3, 64, True, 0)) == (1, 2)
    assert need == 6
    assert pool_shortfall(need, 10) == 0 and pool_shortfall(need, 4) == 2


@pytest.mark.parametrize(
    "groups, steady_steps, state_copy, expected",
    [
        ([_group(ATTENTION, 16)], 3, False, 2),
        ([_group(ATTENTION, 16)], 1, False, 2),
        ([_group(ATTENTION, 16)], 20, False, 3),
        ([_group(ATTENTION, 16), _group(ATTENTION, 16)], 3, False, 4),
        ([_group(ATTENTION, 16), _group(STATE_ALIGN, 16)], 3, True, 4),
        ([_group(ATTENTION, 16), _group(STATE_ALIGN, 16)], 3, False, 3),
    ],
)
def test_shadow_tail_blocks_worst_case(groups, steady_steps, state_copy, expected):
    assert plan_tail_blocks(groups, steady_steps, state_copy) == expected


def test_worst_case_bounds_every_point():
    groups = [_group(ATTENTION, 16), _group(STATE_ALIGN, 32, speculative=1)]
    for planned in (0, 1, 3, 7):
        worst = plan_tail_blocks(groups, planned, state_copy=True)
        steady_steps = max(1, planned)  # what a shadow gets for `planned` steady steps
        assert all(shadow_private_blocks(groups, ctx, steady_steps, True) <= worst for ctx in range(1, 300))
