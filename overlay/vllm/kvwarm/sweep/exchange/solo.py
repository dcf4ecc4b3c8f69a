"""The exchange of a sweep on one rank: nothing to agree with."""

from __future__ import annotations


class SoloExchange:
    """One rank: every exchange completes at once with this rank's own record."""

    size, rank = 1, 0
    kind = None
    on_final = None  # its one rank's writer hands its final artifact on itself (ArtifactWriter.before_final)

    def record(self) -> None:
        return None  # nothing met

    def post(self, kind: str, record: dict) -> None:
        self._posted = [{**record, "kind": kind, "rank": 0}]

    def poll(self) -> list[dict] | None:
        return self._posted

    def post_failure(self, error: str) -> None:
        pass  # no one else to tell

    def share(self, artifact: dict) -> None:
        pass  # one rank: its artifact is the whole record
