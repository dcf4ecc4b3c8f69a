"""A shadow's table in an attention/MLA group: the chain's first ctx // bs blocks shared by
position, a private tail up to the block holding ctx + steady_steps, forked copy-on-write
from the chain's own blocks or fresh and recorded for zeroing."""

from __future__ import annotations

from collections.abc import Callable

from ..record.vocabulary import CHAIN_TOO_SHALLOW
from .arithmetic import cdiv
from .borrowing import GroupTable, ShadowRegistrationError, adopt, fork, take_fresh, touch


def stage_attention(
    group, pool, chain, ctx: int, steady_steps: int, forked: bool, undo, room_past_chain: bool = False
) -> Callable:
    """Check the chain's depth and take the tail's fresh blocks; returns the commit step.
    room_past_chain: the chain need only hold the ctx borrowed positions (a catch-up chain
    of exactly ctx tokens); the tail's blocks past its table are fresh."""
    bs, manager = group.block_size, group.manager
    chain_blocks = manager.req_to_blocks.get(chain.request_id, [])
    n_shared, n_total = ctx // bs, cdiv(ctx + 1 + steady_steps, bs)
    n_held = min(n_total, cdiv(ctx, bs)) if room_past_chain else n_total
    if n_held > len(chain_blocks) or (room_past_chain and chain.num_computed_tokens < ctx):
        raise ShadowRegistrationError(
            CHAIN_TOO_SHALLOW,
            f"group {group.group_id}: chain {chain.request_id!r} is too shallow: it holds "
            f"{len(chain_blocks)} block(s) and {chain.num_computed_tokens} computed token(s), ctx {ctx}"
            + ("" if room_past_chain else f" + steady_steps {steady_steps}")
            + f" needs {n_held} block(s)",
        )
    shared = list(chain_blocks[:n_shared])
    sources = list(chain_blocks[n_shared:n_held]) if forked else []
    fresh = take_fresh(pool, n_total - n_shared, undo)

    def commit(sid: str) -> GroupTable:
        table = GroupTable(group.group_id, n_shared)
        touch(pool, shared + sources, undo)
        rest = fresh[len(sources) :]
        adopt(manager, sid, shared + sources + rest, n_shared, undo)
        table.forks = [
            fork(manager, pool, sid, n_shared + k, source, copy, undo)
            for k, (source, copy) in enumerate(zip(sources, fresh))
        ]
        if rest:
            ids = [b.block_id for b in rest]
            manager.new_block_ids.extend(ids)  # zeroed by the worker where the layout needs it
            undo.push(lambda: [manager.new_block_ids.remove(i) for i in ids])
            table.zero_filled = ids
        return table

    return commit
