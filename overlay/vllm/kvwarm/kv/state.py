"""A shadow's table in an align-mode recurrent-state group (Mamba, gated-delta-net, ...).

The runner reads a request's state at slot (num_computed - 1) // bs and copies it forward
whenever a step crosses into a new slot. A shadow at ctx therefore gets nulls, the
chain's state block at its read slot (ctx - 1) // bs, a blank block at every later slot
its steady steps cross into, then the speculative scratch; the whole table counts as
cached. In place, the shadow shares the chain's state block (and advances it); by copy,
the state is forked with `_apply_cow` like an attention tail.

A shadow's steady steps do a decoding request's state bookkeeping. vLLM's align-mode
manager notes, per request, the slot it last left (after a crossing, a prefill chunk, or a
hit at a state-block boundary), and checks that slot at every step to free what it held.
A shadow comes into its read slot from the slot below, so that slot is noted for it (it is
null in the shadow's table: nothing is freed). A shadow noted nowhere would skip that
check, which a natural request skips only in its first state block after a single-chunk
prefill without a hit. At a crossing a natural request allocates its next state block and
frees the one it left; a shadow's is placed already, and it keeps the one it left.

The chain's state slot is derived from its computed depth: a parked chain's table may
still hold an older state block, and last_state_block_idx may name a slot already nulled.
"""

from __future__ import annotations

from collections.abc import Callable

from ..record.vocabulary import COPY, STATE_MISSING
from .borrowing import GroupTable, ShadowRegistrationError, adopt, fork, take_fresh, touch


def chain_state_slot(group, chain) -> int:
    """The slot of the chain's live state block, checked against its table.

    The table must end exactly at slot + num_speculative_blocks (the state block, then
    its scratch). Shorter: the scratch the runner writes is missing. Longer: vLLM sizes
    an align-mode table for the tokens it schedules, draft tokens included, and keeps the
    running state at the last 1 + num_speculative_blocks blocks, so a table that runs past
    slot + num_speculative_blocks (drafts rejected, or a stale slot) may hold the chain's
    live state elsewhere than at the slot its depth names. Both are refused, with or
    without speculative blocks: a wrong state block would pass for the chain's own.
    """
    bs, spec = group.block_size, group.num_speculative_blocks
    table = group.manager.req_to_blocks.get(chain.request_id, [])
    slot = (chain.num_computed_tokens - 1) // bs
    where = f"chain {chain.request_id!r} at depth {chain.num_computed_tokens}"
    if chain.num_computed_tokens < 1 or slot >= len(table) or table[slot].is_null:
        raise ShadowRegistrationError(STATE_MISSING, f"{where} holds no recurrent state block at slot {slot}")
    last_held = max(i for i, block in enumerate(table) if not block.is_null)
    extra = last_held - spec - slot
    if extra < 0:
        raise ShadowRegistrationError(
            STATE_MISSING,
            f"{where}: its table ends at slot {last_held}, short of its state slot {slot} "
            f"plus {spec} speculative block(s)",
        )
    if extra > 0:
        raise ShadowRegistrationError(
            STATE_MISSING,
            f"{where}: its table runs {extra} block(s) past its state slot {slot} plus {spec} "
            "speculative block(s), so its live state may not be at that slot",
        )
    return slot


def stage_state(group, pool, chain, ctx: int, steady_steps: int, mode: str, undo) -> Callable:
    manager, bs = group.manager, group.block_size
    spec = group.num_speculative_blocks
    state = manager.req_to_blocks[chain.request_id][chain_state_slot(group, chain)]
    read_slot, last_slot = (ctx - 1) // bs, (ctx + steady_steps) // bs
    copy = mode == COPY
    fresh = take_fresh(pool, int(copy) + (last_slot - read_slot) + spec, undo)
    forked_copy, blanks = (fresh[0], fresh[1:]) if copy else (None, fresh)

    def commit(sid: str) -> GroupTable:
        table = [pool.null_block] * (last_slot + 1 + spec)
        table[read_slot] = state
        table[read_slot + 1 :] = blanks
        touch(pool, [state], undo)
        adopt(manager, sid, table, len(table), undo)  # all cached: nothing is ever hashed
        record = GroupTable(group.group_id, 0, state_slot=read_slot, blanks=[b.block_id for b in blanks])
        if copy:
            record.forks = [fork(manager, pool, sid, read_slot, state, forked_copy, undo)]
        note_slot_left(manager, sid, read_slot - 1)
        return record

    return commit


def note_slot_left(manager, request_id: str, slot: int) -> None:
    """What the manager records when a request's state moves on from `slot` (where this
    build keeps that record; unwinding the table forgets it). Nothing below slot 0."""
    left = getattr(manager, "last_state_block_idx", None)
    if left is not None and slot >= 0:
        left[request_id] = slot
