"""Group classification on vLLM's real spec classes, and the block arithmetic with the
upstream checklist's numbers."""

from __future__ import annotations

import pytest
import torch
from real_kv import make_kv_cache_manager

from vllm.kvwarm import layout
from vllm.kvwarm.arithmetic import (
    attention_private_blocks, plan_tail_blocks, pool_shortfall, shadow_private_blocks, state_private_blocks,
)
from vllm.kvwarm.layout import ATTENTION, STATE_ALIGN, GroupLayout


def _attention_spec(cls_name="FullAttentionSpec", **extra):
    from vllm.v1 import kv_cache_interface

    return getattr(kv_cache_interface, cls_name)(
        block_size=16, num_kv_heads=1, head_size=32, dtype=torch.float32, **extra)


def _mamba_spec(mode):
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=64, shapes=((2,),), dtypes=(torch.float32,), mamba_cache_mode=mode)


@pytest.mark.parametrize("make_spec, kind", [
    (lambda: _attention_spec(), layout.ATTENTION),
    (lambda: _attention_spec("MLAAttentionSpec"), layout.ATTENTION),
    # The manager keeps every block of a sliding-window layer folded into full attention.
    (lambda: _attention_spec(sliding_window=128), layout.ATTENTION),
    (lambda: _attention_spec("SlidingWindowSpec", sliding_window=128), layout.UNSUPPORTED),
    (lambda: _attention_spec("ChunkedLocalAttentionSpec", attention_chunk_size=64), layout.UNSUPPORTED),
    (lambda: _mamba_spec("align"), layout.STATE_ALIGN),
    (lambda: _mamba_spec("none"), layout.STATE_OTHER),
    (lambda: _mamba_spec("all"), layout.STATE_OTHER),
])
def test_groups_are_classified_by_spec_and_cache_mode(make_spec, kind):
    assert layout.classify_spec(make_spec()) == kind


def test_group_layouts_of_a_real_manager_follow_group_order():
    kvm = make_kv_cache_manager([32, 16])
    groups = layout.group_layouts(kvm)
    assert [(g.group_id, g.kind, g.block_size) for g in groups] == [(0, ATTENTION, 32), (1, ATTENTION, 16)]
    assert all(g.can_fork for g in groups)  # both builds carry _apply_cow


def _group(kind, block_size, speculative=0):
    return GroupLayout(0, kind, block_size, speculative, manager=None)


@pytest.mark.parametrize("ctx, headroom, block, expected", [
    (40, 3, 16, 1), (47, 3, 16, 2), (48, 0, 16, 1), (100, 3, 16, 1), (126, 3, 16, 2), (127, 0, 128, 1),
])
def test_attention_private_blocks(ctx, headroom, block, expected):
    assert attention_private_blocks(ctx, headroom, block) == expected


def test_pool_precheck_example_of_the_mechanism_notes():
    # Attention bs 16 + align state bs 64, headroom 3, copy mode, shadows at ctx 100 and 126.
    groups = [_group(ATTENTION, 16), _group(STATE_ALIGN, 64)]
    need = sum(shadow_private_blocks(groups, ctx, 3, state_copy=True) for ctx in (100, 126))
    assert (state_private_blocks(100, 3, 64, True, 0), state_private_blocks(126, 3, 64, True, 0)) == (1, 2)
    assert need == 6
    assert pool_shortfall(need, 10) == 0 and pool_shortfall(need, 4) == 2


@pytest.mark.parametrize("groups, repeats, state_copy, expected", [
    ([_group(ATTENTION, 16)], 3, False, 2),
    ([_group(ATTENTION, 16)], 1, False, 2),
    ([_group(ATTENTION, 16)], 20, False, 3),
    ([_group(ATTENTION, 16), _group(ATTENTION, 16)], 3, False, 4),
    ([_group(ATTENTION, 16), _group(STATE_ALIGN, 16)], 3, True, 4),
    ([_group(ATTENTION, 16), _group(STATE_ALIGN, 16)], 3, False, 3),
])
def test_shadow_tail_blocks_worst_case(groups, repeats, state_copy, expected):
    assert plan_tail_blocks(groups, repeats, state_copy) == expected


def test_worst_case_bounds_every_point():
    groups = [_group(ATTENTION, 16), _group(STATE_ALIGN, 32, speculative=1)]
    for repeats in (0, 1, 3, 7):
        worst = plan_tail_blocks(groups, repeats, state_copy=True)
        headroom = max(1, repeats)  # what a shadow gets for `repeats` steady steps
        assert all(shadow_private_blocks(groups, ctx, headroom, True) <= worst for ctx in range(1, 300))
