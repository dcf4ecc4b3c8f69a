"""Fixtures over the real vLLM classes; the builders live in real_kv.py."""

from __future__ import annotations

import pytest
from real_kv import BLOCK_SIZE, BlockPool


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(32, True, hash_block_size=BLOCK_SIZE)
