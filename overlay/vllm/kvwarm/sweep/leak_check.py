"""The end of a sweep (sweep.controller): the leak check. reset_prefix_cache() succeeds only
when nothing but the null block is in use, so requests from outside (a server's) must be done
first: they are waited for up to END_WAIT_SECONDS, after which the check is not made.
"""

from __future__ import annotations

from collections.abc import Callable

# How long the end of a sweep waits for requests from outside before its leak check.
END_WAIT_SECONDS = 60.0


class LeakCheck:
    def __init__(self, clock: Callable[[], float], progress: Callable[[str], None]):
        self.clock, self._progress = clock, progress
        self._since: float | None = None  # when the sweep began waiting for outside requests to end

    def run(self, scheduler) -> tuple[bool, bool | None]:
        """At a schedule() once every point is done: (whether the sweep may end now, the
        check's result: None where it was not made)."""
        if scheduler.requests:
            if self._since is None:
                self._since = self.clock()
            if self.clock() - self._since < END_WAIT_SECONDS:
                return False, None
            self._progress(
                f"{len(scheduler.requests)} request(s) from outside still running: "
                "no leak check (reset_prefix_cache) this time"
            )
            return True, None
        return True, scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
