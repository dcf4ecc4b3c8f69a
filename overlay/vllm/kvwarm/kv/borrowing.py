"""What every group's part of a shadow registration shares: reasons, the record of what
was taken, and the undo log that makes a registration all-or-nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


class ShadowRegistrationError(RuntimeError):
    """Why a shadow was not registered: `reason` is a registration reason of the
    vocabulary (the point that needed it is skipped as decode_injection_failed)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class GroupTable:
    """What a shadow took privately in one group (its table is the manager's)."""

    group_id: int
    num_shared: int  # attention: prefix blocks shared by position; state: 0
    forks: list[tuple[int, int]] = field(default_factory=list)  # (source, private copy)
    zero_filled: list[int] = field(default_factory=list)
    state_slot: int | None = None  # state groups: the slot the runner reads first
    blanks: list[int] = field(default_factory=list)  # state groups: crossed slots, scratch


class Undo:
    """Inverse actions, run newest first when a registration fails part way."""

    def __init__(self):
        self._steps: list[Callable[[], None]] = []

    def push(self, step: Callable[[], None]) -> None:
        self._steps.append(step)

    def run(self) -> None:
        while self._steps:
            self._steps.pop()()


def take_fresh(pool, count: int, undo: Undo) -> list:
    fresh = pool.get_new_blocks(count)
    undo.push(lambda: pool.free_blocks(fresh))
    return fresh


def touch(pool, blocks: list, undo: Undo) -> None:
    pool.touch(blocks)
    undo.push(lambda: pool.free_blocks(blocks))


def adopt(manager, request_id: str, table: list, num_cached: int, undo: Undo) -> None:
    manager.adopt_blocks(request_id, table, num_cached)
    undo.push(lambda: manager.pop_blocks_for_free(request_id))  # refs are undone separately


def fork(manager, pool, request_id: str, slot: int, source, copy, undo: Undo) -> tuple[int, int]:
    """`_apply_cow` on a slot that holds `source` (already touched: its hit-ref becomes
    the retention the scheduler releases)."""
    manager._apply_cow(request_id, slot, source, copy)

    def cancel() -> None:
        manager._pending_cow_copies.remove((source, copy))
        pool.free_blocks([copy])  # the retention ref _apply_cow added

    undo.push(cancel)
    return source.block_id, copy.block_id
