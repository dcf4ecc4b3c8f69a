"""The exchange of a sweep on one rank: nothing to agree with."""

from __future__ import annotations

from ...record import vocabulary as v


class SoloExchange:
    """One rank: every exchange completes at once with this rank's own record."""

    size, rank = 1, 0
    kind = None
    on_final = None  # called with the artifact once it is final

    def record(self) -> None:
        return None  # nothing met

    def post(self, kind: str, record: dict) -> None:
        self._posted = [{**record, "kind": kind, "rank": 0}]

    def poll(self) -> list[dict] | None:
        return self._posted

    def post_failure(self, error: str) -> None:
        pass  # no one else to tell

    def share(self, artifact: dict) -> None:
        """One rank: its artifact is the whole record."""
        if artifact["status"] != v.RUNNING and self.on_final is not None:
            self.on_final([artifact])
