"""Fake KV: a request whose context blocks are allocated but never computed.

The fallback for points no chain covers, and every point when warm-up is off or the
gate refuses the model (the A/B baseline). It is fast and wrong in a known way: MoE
routing and attention read whatever the blocks hold. Every such row is stamped.

A fake request is admitted like a shadow (one token short, as a new request in the
admission step); its prompt tokens are salted so no two requests share a prefix, and it
is never hashed, so nothing it holds can be found by the prefix cache.
"""

from __future__ import annotations

from ..record.vocabulary import POOL_EXHAUSTED
from .borrowing import ShadowRegistrationError
from .request import greedy_request


def salted_sequence(salt: int, count: int, vocab_size: int) -> list[int]:
    """`count` synthetic tokens: an arithmetic sequence over the vocabulary (step 31: no token
    repeats within a vocabulary's length where its size is prime to 31), offset by `salt`, so
    content-dependent paths (MoE routing) see varied tokens, never one repeated."""
    return [(salt * 7919 + 31 * t) % vocab_size for t in range(count)]


def fake_request(request_id: str, ctx: int, max_tokens: int, vocab_size: int, salt: int):
    """A greedy request over ctx + 1 synthetic tokens that decodes `max_tokens` tokens."""
    tokens = salted_sequence(salt, ctx + 1, vocab_size)
    request = greedy_request(request_id, tokens, max_tokens, cache_salt=request_id)
    request.borrowed_kv = True  # KV it did not compute: never hashed
    return request


def allocate_fake(kv_cache_manager, request, ctx: int) -> None:
    """Blocks for the request's ctx + 1 positions, straight from the pool."""
    if kv_cache_manager.allocate_slots(request, ctx + 1) is None:
        raise ShadowRegistrationError(POOL_EXHAUSTED, f"no room for a fake-KV request at context {ctx}")
