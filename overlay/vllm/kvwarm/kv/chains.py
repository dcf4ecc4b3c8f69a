"""Chains: internal requests whose prefilled KV shadows borrow.

A chain is prefilled by the normal scheduler path (chunked prefill, hashed like any
request), then parked: taken out of `running` so no step decodes it, while its blocks
stay resident. It is released through `finish_requests` like any request.
"""

from __future__ import annotations

from .request import greedy_request

CHAIN_PREFIX = "__kvwarm_chain_"  # frontend ids never start like this


def prefix_hasher(scheduler):
    """The block hasher a frontend request of this scheduler gets."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    return get_request_block_hasher(
        scheduler.kv_cache_manager.block_pool.hash_block_size,
        get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo),
    )


def chain_request(scheduler, name: str, token_ids: list[int], salt: str | None = None):
    """A chain over `token_ids` that would decode forever if scheduled (it is parked
    once its prompt is computed). Hashed like any request, so its blocks are cached;
    `salt` (default: its own id) decides which other chains' blocks it may reuse."""
    request_id = f"{CHAIN_PREFIX}{name}"
    return greedy_request(
        request_id, token_ids, 1_000_000, cache_salt=salt or request_id, block_hasher=prefix_hasher(scheduler)
    )


def prompt_scheduled(chain) -> bool:
    """Its whole prompt is scheduled: computed, or in a step still in flight (async scheduling)."""
    return chain.num_computed_tokens >= chain.num_prompt_tokens


def is_prefilled(chain) -> bool:
    """Its whole prompt is computed and no sampled token is still in flight."""
    return prompt_scheduled(chain) and not chain.num_output_placeholders


def all_parked(scheduler, chains) -> bool:
    """Every chain is prefilled and out of `running` (no step will touch it)."""
    return all(is_prefilled(c) and c not in scheduler.running for c in chains)


def park(scheduler, chain) -> None:
    """Stop scheduling the chain; its blocks stay resident and its depth fixed."""
    if chain in scheduler.running:
        scheduler.running.remove(chain)
