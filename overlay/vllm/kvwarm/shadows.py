"""Shadows: a request that borrows a chain's KV blocks by position, in every group or none.

For each attention/MLA group (block size bs) a shadow at context `ctx` with `headroom`
steady steps:
- shares the chain's first ctx // bs blocks (one more ref each, zero copy);
- owns a private tail up to the block holding position ctx + headroom. Where the manager
  can fork, the tail is the chain's own blocks forked copy-on-write (`_apply_cow`, the
  source touched first so its hit-ref becomes the retention the scheduler releases);
  otherwise it is fresh blocks recorded for zeroing;
- has its cached-block count pinned at the shared prefix, and is marked `borrowed_kv`, so
  nothing of it is ever hashed.

Registration stages first (depth checks, the pool pre-check, every fresh block taken),
then commits group by group; any failure unwinds every step already done, so the pool
is exactly as before. Release goes through vLLM's own `KVCacheManager.free`.

Only the hook API of docs/hooks.md is used; capabilities are probed, never versions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .arithmetic import attention_private_blocks, cdiv, pool_shortfall
from .layout import ATTENTION, GroupLayout, group_layouts

# Why a shadow was not registered. The point that needed it is skipped with upstream's
# reason POINT_SKIP_REASON (explicit points raise); these say which check refused it.
POINT_SKIP_REASON = "decode_injection_failed"
CHAIN_TOO_SHALLOW = "chain_too_shallow"
POOL_EXHAUSTED = "pool_exhausted"
LAYOUT_UNSUPPORTED = "layout_unsupported"
FORK_UNSUPPORTED = "fork_unsupported"
HOOKS_MISSING = "hooks_missing"


class ShadowRegistrationError(RuntimeError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class GroupTable:
    """What a shadow took privately in one group (its table is the manager's)."""

    group_id: int
    num_shared: int
    forks: list[tuple[int, int]] = field(default_factory=list)  # (source, private copy)
    zero_filled: list[int] = field(default_factory=list)


@dataclass
class ShadowRegistration:
    shadow_id: str
    ctx: int
    headroom: int
    forked: bool
    groups: list[GroupTable]


def has_borrowing_hooks(kv_cache_manager) -> bool:
    from vllm.v1.request import Request

    managers = kv_cache_manager.coordinator.single_type_managers
    return hasattr(Request, "borrowed_kv") and all(hasattr(m, "adopt_blocks") for m in managers)


def resolve_fork(layouts: list[GroupLayout], fork: bool | None) -> bool:
    """Fork the tails where every group can (None), or as the caller insists."""
    can_fork = all(g.can_fork for g in layouts)
    if fork and not can_fork:
        raise ShadowRegistrationError(FORK_UNSUPPORTED, "a KV-cache group of this build cannot fork blocks")
    return can_fork if fork is None else fork


def private_blocks_needed(layouts: list[GroupLayout], ctx: int, headroom: int) -> int:
    return sum(attention_private_blocks(ctx, headroom, g.block_size) for g in layouts)


class _Undo:
    """Inverse actions, run newest first when a registration fails part way."""

    def __init__(self):
        self._steps: list[Callable[[], None]] = []

    def push(self, step: Callable[[], None]) -> None:
        self._steps.append(step)

    def run(self) -> None:
        while self._steps:
            self._steps.pop()()


def _cancel_fork(manager, pool, source, copy) -> Callable[[], None]:
    def cancel() -> None:
        manager._pending_cow_copies.remove((source, copy))
        pool.free_blocks([copy])  # the retention ref _apply_cow added

    return cancel


def register_shadow(
    kv_cache_manager, shadow, chain_id: str, ctx: int, headroom: int, *, fork: bool | None = None,
) -> ShadowRegistration:
    """Give `shadow` (a vLLM Request without blocks) the chain's KV up to position ctx
    and a private tail for `headroom` steady steps. Raises ShadowRegistrationError (with
    a reason) or the underlying error, in both cases with nothing left registered."""
    if ctx < 1 or headroom < 0:
        raise ValueError(f"need ctx >= 1 and headroom >= 0, got ctx={ctx}, headroom={headroom}")
    if not has_borrowing_hooks(kv_cache_manager):
        raise ShadowRegistrationError(
            HOOKS_MISSING, "this vLLM build lacks adopt_blocks / Request.borrowed_kv (install a kvwarm build)")
    layouts = group_layouts(kv_cache_manager)
    unsupported = [f"group {g.group_id} ({g.kind})" for g in layouts if g.kind != ATTENTION]
    if unsupported:
        raise ShadowRegistrationError(LAYOUT_UNSUPPORTED, ", ".join(unsupported))
    forked = resolve_fork(layouts, fork)
    pool = kv_cache_manager.block_pool
    shortfall = pool_shortfall(private_blocks_needed(layouts, ctx, headroom), pool.get_num_free_blocks())
    if shortfall:
        raise ShadowRegistrationError(POOL_EXHAUSTED, f"{shortfall} more free block(s) needed")

    sid = shadow.request_id
    undo = _Undo()
    try:
        staged = _stage(layouts, pool, chain_id, ctx, headroom, undo)
        tables = [_commit(plan, pool, sid, forked, undo) for plan in staged]
        shadow.borrowed_kv = True
    except BaseException:
        undo.run()
        raise
    return ShadowRegistration(sid, ctx, headroom, forked, tables)


@dataclass
class _GroupPlan:
    layout: GroupLayout
    shared: list
    tail_source: list
    fresh: list


def _stage(layouts, pool, chain_id, ctx, headroom, undo) -> list[_GroupPlan]:
    """Check every group's chain depth and take every fresh block, touching nothing."""
    plans = []
    for group in layouts:
        chain = group.manager.req_to_blocks.get(chain_id, [])
        n_shared, n_total = ctx // group.block_size, cdiv(ctx + 1 + headroom, group.block_size)
        if n_total > len(chain):
            raise ShadowRegistrationError(
                CHAIN_TOO_SHALLOW,
                f"group {group.group_id}: chain {chain_id!r} is too shallow: it holds "
                f"{len(chain)} block(s), ctx {ctx} + headroom {headroom} needs {n_total}",
            )
        fresh = pool.get_new_blocks(n_total - n_shared)
        undo.push(lambda fresh=fresh: pool.free_blocks(fresh))
        plans.append(_GroupPlan(group, list(chain[:n_shared]), list(chain[n_shared:n_total]), fresh))
    return plans


def _commit(plan: _GroupPlan, pool, sid: str, forked: bool, undo: _Undo) -> GroupTable:
    manager, n_shared = plan.layout.manager, len(plan.shared)
    pool.touch(plan.shared)
    undo.push(lambda: pool.free_blocks(plan.shared))
    table = GroupTable(plan.layout.group_id, n_shared)
    if forked:
        # The source's hit-ref is what the scheduler's retention release gives back.
        pool.touch(plan.tail_source)
        undo.push(lambda: pool.free_blocks(plan.tail_source))
        manager.adopt_blocks(sid, plan.shared + plan.tail_source, n_shared)
        undo.push(lambda: manager.pop_blocks_for_free(sid))
        for k, (source, copy) in enumerate(zip(plan.tail_source, plan.fresh)):
            manager._apply_cow(sid, n_shared + k, source, copy)
            undo.push(_cancel_fork(manager, pool, source, copy))
            table.forks.append((source.block_id, copy.block_id))
    else:
        manager.adopt_blocks(sid, plan.shared + plan.fresh, n_shared)
        undo.push(lambda: manager.pop_blocks_for_free(sid))
        ids = [b.block_id for b in plan.fresh]
        manager.new_block_ids.extend(ids)  # zeroed by the worker where the layout needs it
        undo.push(lambda: [manager.new_block_ids.remove(i) for i in ids])
        table.zero_filled = ids
    return table


def release_fork_retentions(kv_cache_manager) -> list:
    """Drain queued forks and release their retained ends now, so the release does not
    land in a measured step; the returned copies must ride the next SchedulerOutput."""
    copies, retained = kv_cache_manager.take_kv_cache_block_copies()
    kv_cache_manager.block_pool.free_blocks(retained)
    return copies
