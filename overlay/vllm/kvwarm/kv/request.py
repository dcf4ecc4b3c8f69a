"""The one place the overlay builds a vLLM `Request` (chains, shadows, fake-KV requests)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def greedy_request(
    request_id: str, token_ids: Sequence[int], max_tokens: int, *, cache_salt: str, block_hasher: Callable | None = None
):
    """A greedy request over `token_ids` that decodes `max_tokens` tokens and never stops
    early (EOS cannot end a measurement). Without `block_hasher` it is never hashed by
    position; `cache_salt` decides which prefix-cache entries it may share."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(token_ids),
        sampling_params=params,
        pooling_params=None,
        cache_salt=cache_salt,
        block_hasher=block_hasher,
    )
