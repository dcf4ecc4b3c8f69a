"""A served-step trace read back (the recorder's format, versions 1 and 2: docs/validate-reference.md):
every rank's file and its rotated predecessors, oldest first, each header checked, every
step line turned into a `Step` (record.trace.steps composes version 2's raw numbers).

A torn last line (the process died mid-write) is reported, not fatal; any other line that is
not a step is an error naming the file and the line. A trace without a single step is
refused by name.

Plain data: nothing here imports vLLM.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .steps import DECODE, KINDS, MIXED, PARSERS, PREFILL, Step, TraceError, parse_step

__all__ = ["DECODE", "KINDS", "MIXED", "PREFILL", "Step", "Trace", "TraceError", "read_trace"]

TRACE_TYPE = "kvwarm_trace"
READS = tuple(PARSERS)  # the trace schema versions this reader knows
TIMING_BASIS = "update_to_update"  # the only timing basis a trace may have: the sweep's decode window
# trace-dp<R>.jsonl (the current file) and trace-dp<R>.<k>.jsonl (rotated, k = 1 the newest)
FILE_NAME = re.compile(r"^trace-dp(\d+)(?:\.(\d+))?\.jsonl$")


@dataclass
class Trace:
    root: Path
    header: dict  # the lowest rank's header: what the trace is compared on
    headers: dict[int, dict]  # per rank
    steps: list[Step] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    torn: list[str] = field(default_factory=list)  # "file: line n", one per torn last line
    step_count: int = 0  # the steps read (held in `steps` unless read_trace was given `keep`)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.headers)

    @property
    def dp_size(self) -> int:
        return int(self.header.get("dp_size") or 1)


def rank_files(root: Path) -> dict[int, list[Path]]:
    """Every rank's files, oldest first: the highest rotation number first, the current last."""
    found: dict[int, list[tuple[int, Path]]] = {}
    for path in root.iterdir():
        match = FILE_NAME.match(path.name)
        if match and path.is_file():
            rotation = int(match.group(2)) if match.group(2) else 0
            found.setdefault(int(match.group(1)), []).append((rotation, path))
    return {rank: [p for _, p in sorted(files, reverse=True)] for rank, files in found.items()}


def _header(path: Path, line: str, rank: int) -> dict:
    where = f"{path}: line 1"
    try:
        header = json.loads(line)
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("type") != TRACE_TYPE:
        raise TraceError(
            f"{where}: not a kvwarm trace header (type {TRACE_TYPE!r}); pass the folder the trace setting "
            "wrote (kvwarm_trace.out)"
        )
    version = header.get("schema_version")
    if version not in READS:
        raise TraceError(
            f"{where}: trace schema_version {version!r}; this reader reads {', '.join(map(str, READS))}: "
            "validate it with the kvwarm build that wrote it, or a newer one"
        )
    if header.get("rank") != rank:
        raise TraceError(f"{where}: header says rank {header.get('rank')!r}, the file's name rank {rank}; rename it")
    timing = header.get("timing") or {}
    if timing.get("basis") != TIMING_BASIS:
        raise TraceError(
            f"{where}: timing basis {timing.get('basis')!r}; a table's steps are timed {TIMING_BASIS} "
            "(one update end to the next), so only such a trace can be held against one"
        )
    return header


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _read_file(path: Path, rank: int, trace: Trace, keep) -> dict | None:
    """The file's header (None for an empty file); each of its steps handed to `keep`, line by
    line (a torn line is known to be the last once no line follows it)."""
    header, torn, first = None, None, ""  # torn: the line number of a line that is not JSON
    try:
        with path.open() as lines:
            for number, line in enumerate(lines, start=1):
                line = line.removesuffix("\n")
                if torn == 1:  # a first line that is not JSON, and more after it: not a trace
                    _header(path, first, rank)
                if torn is not None:
                    raise TraceError(
                        f"{path}: line {torn} is not JSON, and is not the file's last line (a torn write can only "
                        "be the last); the file was edited or damaged"
                    )
                if number == 1:
                    if not _parses(line):  # died writing the header, or not a trace (if more follows)
                        first, torn = line, 1
                        continue
                    header = _header(path, line, rank)
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    torn = number
                    continue
                keep(parse_step(record, rank, f"{path}: line {number}", header["schema_version"]))
                trace.step_count += 1
    except (OSError, UnicodeDecodeError) as err:
        raise TraceError(f"{path}: cannot be read ({err}); pass a trace folder the recorder wrote") from None
    if torn is not None:
        trace.torn.append(f"{path}: line {torn}")
    return header


def read_trace(arg: str | Path, keep: Callable[[Step], None] | None = None) -> Trace:
    """The trace in a folder (or the folder of one of its files). `keep`: each step is handed
    to it as it is read and the trace holds none (`steps` stays empty), for a reader that keeps
    only what it needs of a large trace (sweep.trace_grid)."""
    root = Path(arg)
    if root.is_file() and FILE_NAME.match(root.name):
        root = root.parent
    if not root.is_dir():
        raise TraceError(f"{root}: not a folder; pass the folder the trace setting wrote (kvwarm_trace.out)")
    files = rank_files(root)
    if not files:
        raise TraceError(
            f"{root}: no trace-dp<R>.jsonl here; pass the folder the trace setting wrote (kvwarm_trace.out)"
        )
    trace = Trace(root, {}, {})
    for rank in sorted(files):
        for path in files[rank]:
            header = _read_file(path, rank, trace, keep or trace.steps.append)
            trace.files.append(path)
            if header is None:
                continue
            first = trace.headers.setdefault(rank, header)
            if header.get("started_at") != first.get("started_at"):
                raise TraceError(
                    f"{path}: from a run started at {header.get('started_at')}, the rank's other files at "
                    f"{first.get('started_at')}; keep one run's files in a trace folder"
                )
    if not trace.headers:
        raise TraceError(f"{root}: the trace files are empty (not even a header); the recorder never wrote")
    trace.header = trace.headers[min(trace.headers)]
    for rank, header in trace.headers.items():
        if header.get("dp_size") != trace.header.get("dp_size") or not rank < int(header.get("dp_size") or 1):
            raise TraceError(
                f"{root}: rank {rank}'s header says dp_size {header.get('dp_size')!r}, rank "
                f"{min(trace.headers)}'s {trace.header.get('dp_size')!r}; keep one deployment's files in a trace folder"
            )
    if not trace.step_count:
        torn = f" (only a torn line: {trace.torn[0]})" if trace.torn else ""
        raise TraceError(
            f"{root}: an empty trace: headers but no step recorded{torn}; serve requests with the trace on, "
            "then validate"
        )
    return trace
