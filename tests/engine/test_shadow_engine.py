"""Shadows on the real CPU engine (the scheduler adapter in the engine): a shadow's
greedy tokens over its steady steps equal those of a natural request whose prompt is the
chain's first ctx + 1 tokens, with the tail forked and with it zero-filled."""

from __future__ import annotations

import pytest
from kvwarm_testing.fidelity import CONTEXTS, shadow_and_natural_tokens


@pytest.mark.parametrize("fork", [True, False])
def test_shadows_decode_like_natural_requests_over_the_same_prefix(engine, fork):
    assert type(engine.scheduler).__name__ == "KvWarmScheduler"
    shadow_tokens, natural = shadow_and_natural_tokens(engine.llm, engine.core, fork, f"fidelity-{fork}")
    if fork:  # the forked tail holds the chain's KV for the partial block: exact
        assert shadow_tokens == natural
    else:  # a fresh tail is exact where ctx is block-aligned (128 with block size 32)
        assert shadow_tokens[CONTEXTS.index(128)] == natural[CONTEXTS.index(128)]
