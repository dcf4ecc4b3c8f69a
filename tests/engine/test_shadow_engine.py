"""Shadows on the real CPU engine (the scheduler adapter in the engine): a shadow's
greedy tokens over its steady steps equal those of a natural request whose prompt is the
chain's first ctx + 1 tokens, with the tail forked and with it zero-filled."""

from __future__ import annotations

import random

import pytest

from vllm.kvwarm.chains import chain_request, is_prefilled, park
from vllm.kvwarm.injection import PendingPoint

CONTEXTS = [100, 128, 200, 255]
STEPS = 5  # decoded tokens per shadow: the admission token and 4 steady steps


def _step_core_until(engine, done, limit=200):
    for _ in range(limit):
        if done():
            return
        engine.core.step()
    raise AssertionError("the engine did not get there in time")


@pytest.mark.parametrize("fork", [True, False])
def test_shadows_decode_like_natural_requests_over_the_same_prefix(engine, fork):
    scheduler = engine.scheduler
    pool = engine.kv_cache_manager.block_pool
    assert type(scheduler).__name__ == "KvWarmScheduler"
    tokens = random.Random(1).choices(range(3, 400), k=300)
    chain = chain_request(scheduler, f"fidelity-{fork}", tokens)
    scheduler.add_request(chain)
    _step_core_until(engine, lambda: is_prefilled(chain))
    park(scheduler, chain)

    point = scheduler.kvwarm.queue(PendingPoint([chain] * len(CONTEXTS), CONTEXTS, headroom=STEPS - 1, fork=fork))
    _step_core_until(engine, lambda: point.shadows and all(s.is_finished() for s in point.shadows))
    assert point.failure is None
    shadow_tokens = [list(s.output_token_ids) for s in point.shadows]

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=chain.all_token_ids[: ctx + 1], cache_salt=f"natural-{ctx}")
               for ctx in CONTEXTS]
    natural = [list(out.outputs[0].token_ids) for out in engine.llm.generate(prompts, params, use_tqdm=False)]
    if fork:  # the forked tail holds the chain's KV for the partial block: exact
        assert shadow_tokens == natural
    else:  # a fresh tail is exact where ctx is block-aligned (128 with block size 32)
        assert shadow_tokens[CONTEXTS.index(128)] == natural[CONTEXTS.index(128)]

    from vllm.v1.request import RequestStatus

    scheduler.finish_requests([chain.request_id], RequestStatus.FINISHED_ABORTED)
    engine.core.step()
    assert not [b for b in pool.blocks if b.ref_cnt and not b.is_null]
    assert pool.reset_prefix_cache()
