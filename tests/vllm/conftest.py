"""Helpers to build the real vLLM v1 KV-cache classes of the installed (patched) wheel."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

BLOCK_SIZE = 16


def in_use(pool: BlockPool) -> dict[int, int]:
    """{block_id: ref_cnt} of every block held by someone (the null block's count is not
    maintained by vLLM, so it is left out)."""
    return {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt and not b.is_null}


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(32, True, hash_block_size=BLOCK_SIZE)


def attention_manager(pool: BlockPool, group: int = 0) -> FullAttentionManager:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=32, dtype=torch.float32)
    return FullAttentionManager(
        spec, block_pool=pool, enable_caching=True, kv_cache_group_id=group,
        scheduler_block_size=BLOCK_SIZE,
    )


def mamba_align_manager(pool: BlockPool, group: int = 1) -> MambaManager:
    spec = MambaSpec(
        block_size=BLOCK_SIZE, shapes=((2,), (3,)), dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
    )
    return MambaManager(
        spec, block_pool=pool, enable_caching=True, kv_cache_group_id=group,
        scheduler_block_size=BLOCK_SIZE,
    )
