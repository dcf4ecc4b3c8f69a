"""A shadow's table in an attention/MLA group: the chain's first ctx // bs blocks shared by
position, a private tail up to the block holding ctx + headroom, forked copy-on-write
from the chain's own blocks or fresh and recorded for zeroing."""

from __future__ import annotations

from collections.abc import Callable

from .arithmetic import cdiv
from .borrowing import CHAIN_TOO_SHALLOW, GroupTable, ShadowRegistrationError, adopt, fork, take_fresh, touch


def stage_attention(group, pool, chain, ctx: int, headroom: int, forked: bool, undo) -> Callable:
    """Check the chain's depth and take the tail's fresh blocks; returns the commit step."""
    bs, manager = group.block_size, group.manager
    chain_blocks = manager.req_to_blocks.get(chain.request_id, [])
    n_shared, n_total = ctx // bs, cdiv(ctx + 1 + headroom, bs)
    if n_total > len(chain_blocks):
        raise ShadowRegistrationError(
            CHAIN_TOO_SHALLOW,
            f"group {group.group_id}: chain {chain.request_id!r} is too shallow: it holds "
            f"{len(chain_blocks)} block(s), ctx {ctx} + headroom {headroom} needs {n_total}",
        )
    shared, tail_source = list(chain_blocks[:n_shared]), list(chain_blocks[n_shared:n_total])
    fresh = take_fresh(pool, n_total - n_shared, undo)

    def commit(sid: str) -> GroupTable:
        table = GroupTable(group.group_id, n_shared)
        touch(pool, shared, undo)
        if forked:
            touch(pool, tail_source, undo)
            adopt(manager, sid, shared + tail_source, n_shared, undo)
            table.forks = [fork(manager, pool, sid, n_shared + k, source, copy, undo)
                           for k, (source, copy) in enumerate(zip(tail_source, fresh))]
        else:
            adopt(manager, sid, shared + fresh, n_shared, undo)
            ids = [b.block_id for b in fresh]
            manager.new_block_ids.extend(ids)  # zeroed by the worker where the layout needs it
            undo.push(lambda: [manager.new_block_ids.remove(i) for i in ids])
            table.zero_filled = ids
        return table

    return commit
