"""Chains: internal requests whose prefilled KV shadows borrow.

A chain is prefilled by the normal scheduler path (chunked prefill, hashed like any
request), then parked: taken out of `running` so no step decodes it, while its blocks
stay resident. It is released through `finish_requests` like any request.
"""

from __future__ import annotations

CHAIN_PREFIX = "__kvwarm_chain_"  # frontend ids never start like this


def chain_request(scheduler, name: str, token_ids: list[int], salt: str | None = None):
    """A chain over `token_ids` that would decode forever if scheduled (it is parked
    once its prompt is computed). Hashed like any request, so its blocks are cached;
    `salt` (default: its own id) decides which other chains' blocks it may reuse."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    hasher = get_request_block_hasher(
        scheduler.kv_cache_manager.block_pool.hash_block_size,
        get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo),
    )
    params = SamplingParams(temperature=0.0, max_tokens=1_000_000, ignore_eos=True)
    request_id = f"{CHAIN_PREFIX}{name}"
    return Request(request_id=request_id, prompt_token_ids=list(token_ids), sampling_params=params,
                   pooling_params=None, cache_salt=salt or request_id, block_hasher=hasher)


def is_prefilled(chain) -> bool:
    """Its whole prompt is computed and no sampled token is still in flight."""
    return chain.num_computed_tokens >= chain.num_prompt_tokens and not chain.num_output_placeholders


def park(scheduler, chain) -> None:
    """Stop scheduling the chain; its blocks stay resident and its depth fixed."""
    if chain in scheduler.running:
        scheduler.running.remove(chain)
