"""Exact recurrent state (DYN_BENCH_KV_WARMUP_STATE=exact): catch-up chains.

A copy or in-place shadow reads the chain's state at the chain's whole depth. In exact
mode each shadow at context ctx borrows instead from a catch-up chain: a request over the
chain's first ctx tokens, under the chain's cache salt. vLLM's own prefix cache gives it
the chain's attention blocks and the recurrent state cached at the last block boundary it
finds (align mode keeps the state of every boundary a prefill step ended on); vLLM then
computes the rest, up to ctx, in untimed steps. Parked there, it holds the state of
exactly ctx tokens, which the shadow takes over by in place (or copy) at its own depth.

Exactness rests on vLLM's prefix caching, not on which boundaries are cached: a boundary
state that was evicted only makes the catch-up start from an earlier one (from token 0 at
worst), so the catch-up costs more and the row stays exact. To keep it cheap the rung's
chains are prefilled in steps of one state block (PrefillChunkCap) where the build
lets the scheduler cap a prefill chunk, so every boundary state is cached. Where the KV
cache coordinator keeps only some boundary states (a `retention_interval` other than None:
0 keeps just the prompt's last boundary and shared-prefix junctions), the cap makes it keep
every one while it is applied; where the scheduler lifts the long-prefill threshold for a
lone request, the cap gives such a step a budget of one state block instead
(lone_prefill_budget); where it floors the threshold at a share of the step's budget
(`adaptive_long_prefill_threshold`), the floor is off while the cap is applied.

With chunked prefill off the engine may not split a prompt at all (vLLM then ignores the
threshold on some releases, and a prompt over the step's budget is never scheduled): the cap
leaves the step's budget alone there, so a chain is never stalled, and the chains prefilled
whole leave fewer boundary states cached; the catch-ups start from earlier ones (exact, slower).

A catch-up is parked as soon as its prompt is scheduled, not once its sampled token is
back: a decode step of it would advance its state past ctx.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

from .arithmetic import cdiv
from .chains import chain_request
from .layout import ATTENTION, STATE_ALIGN, GroupLayout


def state_block_size(layouts: list[GroupLayout]) -> int:
    """The largest align-state block size (the boundaries whose states are cached)."""
    return max(g.block_size for g in layouts if g.kind == STATE_ALIGN)


def catchup_request(scheduler, chain, ctx: int, name: str):
    """A chain over `chain`'s first ctx tokens that shares its cache salt (so its prefix
    lookup finds the chain's blocks and boundary states)."""
    return chain_request(scheduler, name, chain.prompt_token_ids[:ctx], salt=chain.cache_salt)


def catchup_blocks(layouts: list[GroupLayout], ctx: int, hit: int) -> int:
    """Free blocks a catch-up over ctx tokens takes when `hit` of them are found in the
    prefix cache: the attention blocks past the hit; per state group the running block with
    its scratch and, after a hit, the boundary block it starts from (cached but free: the
    chain has moved on, so taking it lowers the free count too)."""
    return sum(
        cdiv(ctx, g.block_size) - hit // g.block_size
        if g.kind == ATTENTION
        else 1 + g.num_speculative_blocks + int(hit > 0)
        for g in layouts
        if g.kind in (ATTENTION, STATE_ALIGN)
    )


def planned_catchup_blocks(layouts: list[GroupLayout]) -> int:
    """catchup_blocks when the hit is the last state boundary before ctx (the chains'
    boundaries are cached): at most one state block of tokens past the hit."""
    span = state_block_size(layouts)
    return sum(
        cdiv(span, g.block_size) + 1 if g.kind == ATTENTION else 2 + g.num_speculative_blocks
        for g in layouts
        if g.kind in (ATTENTION, STATE_ALIGN)
    )


def cached_tokens(kv_cache_manager, request) -> int:
    """How many of the request's tokens vLLM's prefix lookup finds cached now."""
    return kv_cache_manager.get_computed_blocks(request)[1]


def is_caught_up(catchup) -> bool:
    """Its whole prompt is scheduled (its state will stand at exactly its prompt)."""
    return catchup.num_computed_tokens >= catchup.num_prompt_tokens


class PrefillChunkCap:
    """While a rung's chains are built: every prefill chunk capped at `size` tokens through
    the scheduler's long-prefill threshold, every boundary state retained by its KV cache
    coordinator, and on a kvwarm scheduler a lone request's step budget capped too
    (lone_prefill_budget); restore() puts each setting back. A build without a setting
    keeps its own behaviour there (the catch-ups then start from earlier boundaries: exact
    all the same, only slower)."""

    SETTING = "long_prefill_token_threshold"  # the scheduler config's
    CHUNKED = "enable_chunked_prefill"  # the scheduler config's; False: prompts may not be split
    ADAPTIVE = "adaptive_long_prefill_threshold"  # the scheduler's; True floors the threshold
    RETENTION = "retention_interval"  # the coordinator's; None keeps every boundary state
    LONE_CAP = "kvwarm_prefill_cap"  # a kvwarm scheduler's; read by lone_prefill_budget

    def __init__(self, scheduler, size: int):
        self._scheduler, self._size = scheduler, size
        self._applied = False
        self._saved: int | None = None  # the threshold, where it was changed
        self._retention: int | None = None  # the coordinator's retention, where it was changed
        self._adaptive = False  # whether the scheduler's adaptive floor was on (and is now off)

    def _coordinator(self):
        return getattr(getattr(self._scheduler, "kv_cache_manager", None), "coordinator", None)

    def apply(self) -> None:
        if self._applied:
            return
        self._applied = True
        config = self._scheduler.scheduler_config
        if hasattr(config, self.SETTING):
            self._saved = getattr(config, self.SETTING)
            capped = self._size if not self._saved or self._saved <= 0 else min(self._saved, self._size)
            setattr(config, self.SETTING, capped)
        coordinator = self._coordinator()
        if getattr(coordinator, self.RETENTION, None) is not None:
            self._retention = getattr(coordinator, self.RETENTION)
            setattr(coordinator, self.RETENTION, None)
        if getattr(self._scheduler, self.ADAPTIVE, False) is True:
            self._adaptive = True
            setattr(self._scheduler, self.ADAPTIVE, False)
        if hasattr(self._scheduler, self.LONE_CAP) and getattr(config, self.CHUNKED, True) is not False:
            setattr(self._scheduler, self.LONE_CAP, self._size)

    def restore(self) -> None:
        if not self._applied:
            return
        self._applied = False
        if self._saved is not None:
            setattr(self._scheduler.scheduler_config, self.SETTING, self._saved)
            self._saved = None
        if self._retention is not None:
            setattr(self._coordinator(), self.RETENTION, self._retention)
            self._retention = None
        if self._adaptive:
            setattr(self._scheduler, self.ADAPTIVE, True)
            self._adaptive = False
        if hasattr(self._scheduler, self.LONE_CAP):
            setattr(self._scheduler, self.LONE_CAP, None)


def lone_prefill_budget(scheduler):
    """The context for one schedule() of a kvwarm scheduler: while a PrefillChunkCap is
    applied and a single request is eligible, the step's token budget is the cap. vLLM's
    scheduler may lift the long-prefill threshold for a lone request (nobody to starve); the
    budget then caps its chunk the same way, so a lone chain is prefilled one state block
    per step too. Every other step (timed ones included) gets a no-op context."""
    size = getattr(scheduler, PrefillChunkCap.LONE_CAP, None)
    if not size:
        return nullcontext()
    counts = getattr(scheduler, "get_request_counts", None)
    if counts is None or sum(counts()) > 1 or not hasattr(scheduler, "max_num_scheduled_tokens"):
        return nullcontext()
    return _step_budget(scheduler, min(scheduler.max_num_scheduled_tokens, size))


@contextmanager
def _step_budget(scheduler, budget: int):
    saved = scheduler.max_num_scheduled_tokens
    scheduler.max_num_scheduled_tokens = budget
    try:
        yield
    finally:
        scheduler.max_num_scheduled_tokens = saved
