"""Shadows: a request that borrows a chain's KV by position, in every group or none.

`register_shadow` gives a shadow request (a vLLM Request with no blocks yet) the chain's
KV up to position ctx and private room for `steady_steps` steady steps, group by group:
attention/MLA groups as in kv.attention, align-mode state groups as in kv.state.
A shadow with keys of its own (a block hasher under its own salt, as the injector builds
it) is hashed like any request past what it borrows, so a steady step does the
prefix-cache work a natural request's does: attention groups' cached counts are pinned at
the shared prefix, state groups' at the whole table, and the blocks it fills itself are
cached under keys nothing else computes. Not in place: there the shadow's state block is
the chain's, and a state manager that hashes partial tails would key it under the shadow.
A shadow in place, or without keys of its own, is marked `borrowed_kv`: nothing of it is
ever hashed.

It stages first (the pool pre-check, every depth check, every fresh block), then commits
group by group; any failure unwinds every step already done, so the pool is exactly as
before. Release goes through vLLM's own `KVCacheManager.free`; the fork retentions are
released by `release_fork_retentions` right after admission.

Only the hook API of docs/hooks.md is used; capabilities are probed, never versions.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..record.vocabulary import (
    COPY,
    FORK_UNSUPPORTED,
    HOOKS_MISSING,
    INPLACE,
    LAYOUT_UNKNOWN,
    LAYOUT_UNSUPPORTED,
    POOL_EXHAUSTED,
    STATE_MODE_UNUSABLE,
)
from .arithmetic import pool_shortfall, shadow_private_blocks
from .attention import stage_attention
from .borrowing import GroupTable, ShadowRegistrationError, Undo
from .layout import ATTENTION, STATE_ALIGN, UNKNOWN, GroupLayout, group_layouts
from .state import stage_state
from .state_mode import probe_state_build


@dataclass
class ShadowRegistration:
    shadow_id: str
    ctx: int
    steady_steps: int
    forked: bool  # attention tails forked (else zero-filled)
    state_mode: str | None  # copy | inplace on layouts with state groups
    groups: list[GroupTable]


def has_borrowing_hooks(kv_cache_manager) -> bool:
    from vllm.v1.request import Request

    managers = kv_cache_manager.coordinator.single_type_managers
    return hasattr(Request, "borrowed_kv") and all(hasattr(m, "adopt_blocks") for m in managers)


def resolve_fork(layouts: list[GroupLayout], fork: bool | None) -> bool:
    """Fork attention tails where every attention group can (None), or as the caller insists."""
    can_fork = all(g.can_fork for g in layouts if g.kind == ATTENTION)
    if fork and not can_fork:
        raise ShadowRegistrationError(FORK_UNSUPPORTED, "an attention group of this build cannot fork blocks")
    return can_fork if fork is None else fork


def _check_layout(kv_cache_manager, layouts: list[GroupLayout], state_mode: str | None) -> str | None:
    unknown = [f"group {g.group_id}: {g.detail}" for g in layouts if g.kind == UNKNOWN]
    if unknown:
        raise ShadowRegistrationError(LAYOUT_UNKNOWN, "; ".join(unknown))
    unsupported = [
        f"group {g.group_id} ({g.kind}: {g.detail})" for g in layouts if g.kind not in (ATTENTION, STATE_ALIGN)
    ]
    if unsupported:
        raise ShadowRegistrationError(LAYOUT_UNSUPPORTED, ", ".join(unsupported))
    state_groups = [g for g in layouts if g.kind == STATE_ALIGN]
    if not state_groups:
        return None
    if state_mode not in (COPY, INPLACE):
        raise ShadowRegistrationError(STATE_MODE_UNUSABLE, f"state mode {state_mode!r} is not copy or inplace")
    build = probe_state_build(layouts, kv_cache_manager)
    if state_mode == COPY and not build.can_fork:
        raise ShadowRegistrationError(STATE_MODE_UNUSABLE, "copy mode needs state managers that can fork")
    if state_mode == INPLACE and not build.inplace_ok:
        raise ShadowRegistrationError(
            STATE_MODE_UNUSABLE, "in place needs state managers that never hash a borrowed request's partial tail"
        )
    return state_mode


def check_pool(
    kv_cache_manager,
    layouts: list[GroupLayout],
    contexts: list[int],
    steady_steps: int,
    state_mode: str | None,
    what: str = "",
) -> None:
    """The pool pre-check: every private block the shadows at `contexts` need is free now."""
    need = sum(shadow_private_blocks(layouts, ctx, steady_steps, state_copy=state_mode == COPY) for ctx in contexts)
    shortfall = pool_shortfall(need, kv_cache_manager.block_pool.get_num_free_blocks())
    if shortfall:
        raise ShadowRegistrationError(POOL_EXHAUSTED, f"{shortfall} more free block(s) needed{what}")


def register_shadow(
    kv_cache_manager,
    shadow,
    chain,
    ctx: int,
    steady_steps: int,
    *,
    fork: bool | None = None,
    state_mode: str | None = None,
    room_past_chain: bool = False,
    own_keys: bool = False,
) -> ShadowRegistration:
    """Raises ShadowRegistrationError (with a reason) or the underlying error, in both
    cases with nothing left registered. `chain` is the lending Request; `state_mode`
    (copy | inplace, see state_mode.resolve_state_mode) is required on hybrid layouts.
    room_past_chain: the chain holds exactly ctx tokens (an exact-state catch-up); the
    shadow's tail past it is fresh. own_keys: the shadow carries a block hasher salted with
    its own id (see the module's docstring for where it is then hashed)."""
    if ctx < 1 or steady_steps < 0:
        raise ValueError(f"need ctx >= 1 and steady_steps >= 0, got ctx={ctx}, steady_steps={steady_steps}")
    if not has_borrowing_hooks(kv_cache_manager):
        raise ShadowRegistrationError(
            HOOKS_MISSING, "this vLLM build lacks adopt_blocks / Request.borrowed_kv (install a kvwarm build)"
        )
    layouts = group_layouts(kv_cache_manager)
    mode = _check_layout(kv_cache_manager, layouts, state_mode)
    forked = resolve_fork(layouts, fork)
    pool = kv_cache_manager.block_pool
    check_pool(kv_cache_manager, layouts, [ctx], steady_steps, mode)

    undo = Undo()
    try:
        commits = [
            stage_attention(g, pool, chain, ctx, steady_steps, forked, undo, room_past_chain)
            if g.kind == ATTENTION
            else stage_state(g, pool, chain, ctx, steady_steps, mode, undo)
            for g in layouts
        ]
        tables = [commit(shadow.request_id) for commit in commits]
        shadow.borrowed_kv = not own_keys or mode == INPLACE
    except BaseException:
        undo.run()
        raise
    return ShadowRegistration(shadow.request_id, ctx, steady_steps, forked, mode, tables)


def release_fork_retentions(kv_cache_manager) -> list:
    """Drain queued forks and release their retained ends now, so the release does not
    land in a measured step; the returned copies must ride the next SchedulerOutput."""
    copies, retained = kv_cache_manager.take_kv_cache_block_copies()
    kv_cache_manager.block_pool.free_blocks(retained)
    return copies
