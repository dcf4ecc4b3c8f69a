"""Prefixes in the prefix cache for prefill points: the unit a hit is counted in, how many of
a request's tokens a lookup finds, and fake prefixes: blocks registered and hashed through
vLLM's own allocate_slots (which caches a request's full blocks as it allocates them) but
never computed, as the legacy path does.
"""

from __future__ import annotations

import math

from ..record.vocabulary import POOL_EXHAUSTED
from .arithmetic import cdiv
from .borrowing import ShadowRegistrationError
from .chains import chain_request
from .layout import ATTENTION, STATE_ALIGN, GroupLayout


def prefix_unit(layouts: list[GroupLayout], hash_block_size: int) -> int:
    """The granularity of a prefix-cache hit: every group's block (an align-mode state group
    hits only at its block boundaries) and the prefix-match unit."""
    return math.lcm(hash_block_size, *(g.block_size for g in layouts if g.kind in (ATTENTION, STATE_ALIGN)))


def new_request_blocks(layouts: list[GroupLayout], prefix: int, new: int) -> int:
    """Free blocks a new request over `prefix` cached tokens and `new` more takes: the
    attention blocks past the hit; per state group its running block and scratch and, after
    a hit, the boundary block it starts from (cached but free where the chain has moved on,
    so taking it lowers the free count too; kv.catchup counts a catch-up's the same way)."""
    return sum(
        cdiv(prefix + new, g.block_size) - prefix // g.block_size
        if g.kind == ATTENTION
        else 1 + g.num_speculative_blocks + int(prefix > 0)
        for g in layouts
        if g.kind in (ATTENTION, STATE_ALIGN)
    )


def fake_prefix(scheduler, name: str, tokens: list[int]):
    """A request over `tokens` whose blocks are allocated and hashed (so a request with the
    same tokens and salt finds them cached) but never computed. It never enters the
    scheduler; give its blocks back with kv_cache_manager.free(request)."""
    seed = chain_request(scheduler, name, tokens)
    if scheduler.kv_cache_manager.allocate_slots(seed, len(tokens)) is None:
        raise ShadowRegistrationError(POOL_EXHAUSTED, f"no room for a fake prefix of {len(tokens)} tokens")
    return seed
