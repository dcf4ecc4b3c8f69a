"""The worker's copy-on-write page copy refuses a KV layout whose blocks are not pages.

Every series carries this check: a stock build either copies a K/V-first cache's bytes
silently and wrongly or has no copy at all (the releases' series_tests prove which fail).
"""

from __future__ import annotations

import pytest
import torch


def test_kv_first_layout_is_refused_with_its_shape_and_left_untouched(torch_device):
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    num_blocks = 6
    kv_first = torch.randn(2, num_blocks, 4, 1, 8, device=torch_device)  # [K/V, blocks, slots, heads, dim]
    before = kv_first.clone()
    with pytest.raises(ValueError, match=r"block-major.*\(2, 6, 4, 1, 8\)"):
        copy_kv_cache_blocks_inplace([kv_first], num_blocks, [KVCacheBlockCopy(1, 4)])
    assert torch.equal(kv_first, before)
