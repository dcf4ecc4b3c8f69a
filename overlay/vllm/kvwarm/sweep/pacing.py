"""The pace of a periodic write whose cost grows with what it writes (a sweep's running record,
rank 0's combined view): once a write has cost something, the next ones are left out until it
is paid for, so that rewriting takes at most `share` of the time. A write that cost no more
than `floor` seconds never holds the next back. The caller writes a final record whatever
the pace says.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Pacing:
    def __init__(self, share: float, floor: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.share, self.floor, self.clock = share, floor, clock
        self._cost = 0.0  # the last write's seconds
        self._wrote_at = 0.0  # when it ended

    def due(self) -> bool:
        """Whether a write now keeps the writes' share of the time since the last one's start
        within `share`."""
        if self._cost <= self.floor:
            return True
        return self.clock() - self._wrote_at >= self._cost * (1 / self.share - 1)

    def wrote(self, began: float) -> None:
        """A write that began at `began` (this pacing's clock) has just ended."""
        self._wrote_at = self.clock()
        self._cost = self._wrote_at - began
