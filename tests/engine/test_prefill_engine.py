"""Prefill points on the real CPU engine (tiny Llama, in this process): a request over chain i's
first kv tokens plus a fresh tail, under the chain's cache salt, is a prefix-cache hit of
exactly kv tokens, as vLLM itself counts it (RequestOutput.num_cached_tokens of the same prompt
sent through the frontend), and its first token equals that of a request that prefilled the
whole prompt itself (no hit)."""

from __future__ import annotations

import random

from kvwarm_testing.fidelity import step_core_until
from vllm.kvwarm.kv.chains import chain_request, is_prefilled, park, prefix_hasher
from vllm.kvwarm.kv.request import greedy_request

PREFIX, TAIL = 128, 40  # a whole number of the tests' 32-token blocks, then new tokens


def _first_token_of_internal_request(engine, request) -> tuple[int, int]:
    """(its sampled token, the prefix hit vLLM scheduled it with) for an internal request."""
    scheduler, hits, tokens = engine.scheduler, [], []
    schedule = scheduler.schedule

    def recording(*args, **kwargs):
        output = schedule(*args, **kwargs)
        hits.extend(r.num_computed_tokens for r in output.scheduled_new_reqs if r.req_id == request.request_id)
        return output

    scheduler.schedule = recording
    try:
        scheduler.add_request(request)
        step_core_until(engine.core, lambda: request.request_id not in scheduler.requests)
    finally:
        scheduler.schedule = schedule
    tokens = list(request.output_token_ids)
    return tokens[0], hits[0]


def test_a_real_prefix_hit_is_the_prefix_vllm_counts_and_decodes_like_a_whole_prefill(engine):
    from vllm.v1.request import RequestStatus

    scheduler = engine.scheduler
    rng = random.Random(7)
    chain = chain_request(scheduler, "prefill-fidelity", [rng.randrange(3, 250) for _ in range(PREFIX + 64)])
    scheduler.add_request(chain)
    try:
        step_core_until(engine.core, lambda: is_prefilled(chain))
        park(scheduler, chain)
        prefix = chain.prompt_token_ids[:PREFIX]
        tail, other_tail = ([rng.randrange(3, 250) for _ in range(TAIL)] for _ in range(2))
        shot = greedy_request(
            "__kvwarm_prefill_fidelity",
            prefix + tail,
            1,
            cache_salt=chain.cache_salt,
            block_hasher=prefix_hasher(scheduler),
        )
        token, hit = _first_token_of_internal_request(engine, shot)
        assert hit == PREFIX
        # vLLM's own count for the chain's prefix and a tail of its own, through the frontend;
        # and the shot's prompt computed whole, under a salt of its own
        engine.add("on-the-chain", prefix + other_tail, max_tokens=1, salt=chain.cache_salt)
        engine.add("from-scratch", prefix + tail, max_tokens=1, salt="a-salt-of-its-own")
        finished = engine.run_to_completion()
        assert finished["on-the-chain"].num_cached_tokens == PREFIX
        assert finished["from-scratch"].num_cached_tokens == 0
        assert finished["from-scratch"].outputs[0].token_ids[0] == token
    finally:
        scheduler.finish_requests([chain.request_id], RequestStatus.FINISHED_ABORTED)
        engine.core.step()
    assert scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
