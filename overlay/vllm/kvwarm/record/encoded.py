"""A running artifact's rows, each encoded once: the sweep rewrites its running sweep.json after
many of its points (sweep.writer), and were every row encoded again each time, a write at
10,000 rows would stall the engine's thread for a tenth of a second and more. Each row's entry
(record.artifact.entry) is made into compact JSON the first time it is written; a write then
joins the bytes, which costs little per row.

Plain data: nothing here imports vLLM.
"""

from __future__ import annotations

import json

from .artifact import PointRow, entry, split

COMPACT = (",", ":")


class EncodedRows:
    def __init__(self, size: int):
        """`size`: the data-parallel size (a row's global batch)."""
        self.size = size
        self._made: dict[int, tuple[PointRow, bytes]] = {}  # id(row): the row (kept alive), its entry's JSON

    def _json(self, row: PointRow) -> bytes:
        made = self._made.get(id(row))
        if made is None or made[0] is not row:
            made = (row, json.dumps(entry(row, self.size), separators=COMPACT).encode())
            self._made[id(row)] = made
        return made[1]

    def dumps(self, head: dict, rows: list[PointRow]) -> bytes:
        """The compact JSON of the artifact of `rows` under `head` (record.artifact.artifact_head),
        as json.dumps would write build_artifact's (its keys in another order)."""
        parts = [json.dumps(head, separators=COMPACT).encode()[:-1]]
        for name, side in split(rows, head):
            measured = b",".join(self._json(r) for r in side if not r.skipped)
            skipped = b",".join(self._json(r) for r in side if r.skipped)
            lists = b'"results":[%s],"skipped_points":[%s]' % (measured, skipped)
            parts.append(lists if name is None else b'"%s":{%s}' % (name.encode(), lists))
        return b",".join(parts) + b"}"

    def keep(self, rows: list[PointRow]) -> None:
        """Forget the rows no longer written (a resume's dropped ones)."""
        ids = {id(r) for r in rows}
        self._made = {i: made for i, made in self._made.items() if i in ids}
