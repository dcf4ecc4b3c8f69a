"""rows.jsonl: a rank's rows as they are measured, one compact JSON line each, appended and
flushed beside its sweep.json, so a process killed mid-sweep (SIGKILL, the OOM killer) loses
at most the point it was measuring. sweep.json is rewritten only at a pace (sweep.writer);
its rows are this file's, folded in. A resumed sweep (sweep.resume) reads its rows back from
here.

Lines (docs/artifact.md#rowsjsonl):
  {"kind": "boot", "boot": 0, "started_at": "...Z", "resumed": false}    each boot's first
  {"kind": "row", "boot": 0, "index": 3, "done": 4, "planned": 42, "at": 1733740800.123,
   "row": {PointRow's fields}}                                          each finished row
  {"kind": "stage", "boot": 0, "stage": {"batch": 4, "depth": 2254, "build_seconds": 1.5}}
A later row line for the same (index, row.ab) replaces an earlier one. A last line without
its newline was torn by a kill: readers leave it out (and a resume cuts it off before it
appends). Kinds a reader does not know are skipped.

Plain data: nothing here imports vLLM. The lines are flushed to the operating system, not
synced to the disk: a killed process loses nothing written, a host that loses power may lose
the last lines the system had not written yet.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import vocabulary as v
from .artifact import PointRow

BOOT, ROW, STAGE = "boot", "row", "stage"


def row_record(row: PointRow) -> dict:
    return dataclasses.asdict(row)


def row_from_record(record: dict) -> PointRow:
    """A row as its line holds it; fields this build does not know are left out."""
    names = {f.name for f in dataclasses.fields(PointRow)}
    return PointRow(**{k: val for k, val in record.items() if k in names})


class RowLog:
    """The engine's side: one open file, appended to in the engine's thread."""

    def __init__(self, folder: str | Path, boot: int, started_at: str):
        """A fresh sweep (boot 0) starts the file anew; a resumed one appends to it, after
        cutting off a torn last line."""
        self.path = Path(folder) / v.ROWS
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if boot:
            cut_torn_tail(self.path)
        self.boot = boot
        self._file = self.path.open("ab" if boot else "wb")
        self._append({"kind": BOOT, "boot": boot, "started_at": started_at, "resumed": boot > 0})

    def row(self, row: PointRow, index: int, done: int, planned: int) -> None:
        """`index`: the point's place in the sweep's point list; `done`: rows the artifact
        holds with this one; `planned`: rows it holds once complete."""
        at = round(time.time(), 3)
        record = {"kind": ROW, "boot": self.boot, "index": index, "done": done, "planned": planned, "at": at}
        self._append({**record, "row": row_record(row)})

    def stage(self, stage: dict) -> None:
        self._append({"kind": STAGE, "boot": self.boot, "stage": stage})

    def _append(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def cut_torn_tail(path: Path) -> None:
    """Cut the file after its last newline: what follows was torn by a kill mid-write."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)


@dataclass
class Logged:
    """What a rows.jsonl holds, folded: the rows by (point index, A/B side), in the order
    they were first measured, the boots and the rungs built."""

    rows: dict[tuple[int, str | None], tuple[int, PointRow]] = field(default_factory=dict)  # -> (boot, row)
    boots: list[dict] = field(default_factory=list)  # each boot's line
    stages: list[dict] = field(default_factory=list)  # each stage, with its boot
    torn: bool = False  # the last line was torn

    @property
    def next_boot(self) -> int:
        return max((b["boot"] for b in self.boots), default=-1) + 1


def read_log(path: str | Path) -> Logged:
    """The folded content of a rows.jsonl (FileNotFoundError where there is none). A line
    that is not JSON is refused (ValueError naming it), except a torn last one."""
    path = Path(path)
    data = path.read_bytes()
    logged = Logged()
    lines = data.split(b"\n")
    logged.torn = lines[-1] != b""
    for number, line in enumerate(lines[:-1], start=1):
        try:
            record = json.loads(line)
        except ValueError:
            raise ValueError(f"{path}: line {number} is not JSON; the file was edited or is not a sweep's") from None
        kind = record.get("kind") if isinstance(record, dict) else None
        if kind == BOOT:
            logged.boots.append(record)
        elif kind == STAGE:
            logged.stages.append({**record["stage"], "boot": record["boot"]})
        elif kind == ROW:
            row = row_from_record(record["row"])
            logged.rows.pop((record["index"], row.ab), None)  # a replacement goes where it was measured
            logged.rows[(record["index"], row.ab)] = (record["boot"], row)
    return logged
