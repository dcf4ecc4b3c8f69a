"""Fixtures over the real vLLM classes; the builders live in real_kv.py."""

from __future__ import annotations

import pytest
import torch
from kvwarm_testing.real_kv import BLOCK_SIZE, BlockPool

# The worker's page copies run on every device this host has: CPU here, CUDA on a GPU host.
TORCH_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=TORCH_DEVICES)
def torch_device(request) -> str:
    return request.param


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(32, True, hash_block_size=BLOCK_SIZE)
