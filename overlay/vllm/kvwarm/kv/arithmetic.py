"""Block counts for shadows: what one shadow takes privately, and the plan's worst case.

A shadow at context `ctx` decodes `steady_steps` steady steps after its admission token, so it
writes positions ctx .. ctx+steady_steps. Pure functions of the layout, the point and the
state mode, so every data-parallel rank computes the same numbers.
"""

from __future__ import annotations

from .layout import ATTENTION, STATE_ALIGN, GroupLayout


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def attention_private_blocks(ctx: int, steady_steps: int, block_size: int) -> int:
    """The tail a shadow owns: from the block holding position ctx to the one holding
    ctx+steady_steps; the ctx // block_size full blocks before it are shared."""
    return cdiv(ctx + 1 + steady_steps, block_size) - ctx // block_size


def state_private_blocks(ctx: int, steady_steps: int, block_size: int, copy: bool, speculative: int) -> int:
    """A fork of the chain's state (copy mode), a blank block at every slot the steady
    steps cross into, and the speculative scratch."""
    crossings = (ctx + steady_steps) // block_size - (ctx - 1) // block_size
    return int(copy) + crossings + speculative


def shadow_private_blocks(layouts: list[GroupLayout], ctx: int, steady_steps: int, state_copy: bool) -> int:
    """Free blocks one shadow needs, summed over its groups."""
    total = 0
    for group in layouts:
        if group.kind == ATTENTION:
            total += attention_private_blocks(ctx, steady_steps, group.block_size)
        elif group.kind == STATE_ALIGN:
            total += state_private_blocks(ctx, steady_steps, group.block_size, state_copy, group.num_speculative_blocks)
    return total


def plan_tail_blocks(layouts: list[GroupLayout], steady_steps: int, state_copy: bool) -> int:
    """Worst case of shadow_private_blocks over every ctx, for planning a rung before
    its points are known (at least two steady steps of steady_steps are assumed)."""
    span = max(2, steady_steps)
    total = 0
    for group in layouts:
        if group.kind == ATTENTION:
            total += 1 + cdiv(span, group.block_size)
        elif group.kind == STATE_ALIGN:
            total += int(state_copy) + cdiv(span + 1, group.block_size) + group.num_speculative_blocks
    return total


def chain_blocks(layouts: list[GroupLayout], depth: int) -> int:
    """Blocks one parked chain of `depth` tokens holds: every attention block, and one
    state block (plus speculative scratch) per align-state group."""
    return sum(
        cdiv(depth, g.block_size) if g.kind == ATTENTION else 1 + g.num_speculative_blocks
        for g in layouts
        if g.kind in (ATTENTION, STATE_ALIGN)
    )


def trim_depth(
    layouts: list[GroupLayout],
    depth: int,
    batch: int,
    steady_steps: int,
    state_copy: bool,
    free_blocks: int,
    floor: int = 8,
    per_shadow: int = 0,
) -> int:
    """The deepest chain depth (at most `depth`, at least `floor`) at which a rung's
    `batch` chains and their shadows' worst-case tails fit in `free_blocks`; `per_shadow`
    more blocks for each shadow (exact mode: its catch-up chain)."""
    tail = plan_tail_blocks(layouts, steady_steps, state_copy) + per_shadow
    while depth > floor and (chain_blocks(layouts, depth) + tail) * batch > free_blocks:
        depth -= 1
    return depth


def pool_shortfall(need: int, free_blocks: int) -> int:
    """How many blocks are missing for `need` private blocks (0 when they fit)."""
    return max(0, need - free_blocks)
