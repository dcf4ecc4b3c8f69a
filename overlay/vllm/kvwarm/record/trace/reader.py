"""A served-step trace read back (the recorder's format, versions 1 to 3: docs/validate-reference.md):
every launch's files of every rank, each launch's current file and its rotated predecessors
oldest first, each header checked, every step line turned into a `Step` (record.trace.steps
composes the raw numbers of versions 2 and 3), every record of steps dropped at the writer's
bound kept (`Dropped`).

A launch's files are one stream: trace-dp<R>-<LAUNCH>.jsonl (record.vocabulary.trace_file_name;
files written before launches had names, trace-dp<R>.jsonl, are one stream per rank). Several
engines of one data-parallel rank writing to one folder (several DP=1 servers sharing it, or
one server started again) are several streams of that rank, each with its own header and its
own step numbers; `Step.stream` tells them apart and `Trace.notes` says so.

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
from datetime import datetime
from pathlib import Path

from .steps import DECODE, KINDS, MIXED, PARSERS, PREFILL, Step, TraceError, parse_step

__all__ = ["DECODE", "KINDS", "MIXED", "PREFILL", "Dropped", "Step", "Stream", "Trace", "TraceError", "read_trace"]

TRACE_TYPE = "kvwarm_trace"
READS = tuple(PARSERS)  # the trace schema versions this reader knows
TIMING_BASIS = "update_to_update"  # the only timing basis a trace may have: the sweep's decode window
DROPPED = "dropped"  # a record of steps dropped at the writer's bound (record.vocabulary.TRACE_DROPPED)
# trace-dp<R>-<LAUNCH>.jsonl (the current file) and trace-dp<R>-<LAUNCH>.<k>.jsonl (rotated, k = 1
# the newest); without -<LAUNCH>, the names of traces written before launches were named
FILE_NAME = re.compile(r"^trace-dp(?P<rank>\d+)(?:-(?P<launch>\d{8}T\d{12}-p\d+))?(?:\.(?P<rotation>\d+))?\.jsonl$")


@dataclass
class Stream:
    """One launch's steps of one rank: its header and files (oldest first)."""

    index: int  # Step.stream of its steps
    rank: int
    launch: str  # "" for files named by rank alone
    files: list[Path]
    header: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Dropped:
    """Steps the writer dropped at its bound (their numbers skip by `steps`)."""

    stream: int
    steps: int  # traced steps
    untraced: int  # steps the trace leaves out (a sweep's, those that scheduled nothing), dropped too
    start: float  # the first dropped step's `at`
    end: float  # the last's
    where: str  # file: line


@dataclass
class Trace:
    root: Path
    header: dict  # the lowest rank's first stream's header: what the trace is compared on
    headers: dict[int, dict]  # per rank, its first stream's
    steps: list[Step] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    torn: list[str] = field(default_factory=list)  # "file: line n", one per torn last line
    streams: list[Stream] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)
    step_count: int = 0  # the steps read (held in `steps` unless read_trace was given `keep`)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.headers)

    @property
    def dp_size(self) -> int:
        return int(self.header.get("dp_size") or 1)

    @property
    def notes(self) -> list[str]:
        """What a reader of this trace should know beyond its steps: several launches of a
        rank, steps dropped at the writer's bound."""
        notes = []
        for rank in self.ranks:
            streams = [s for s in self.streams if s.rank == rank and s.header]
            if len(streams) > 1:
                launches = ", ".join(s.launch or "unnamed" for s in streams)
                notes.append(f"rank {rank}: {len(streams)} launches in this folder ({launches}), each its own stream")
        for gap in self.dropped:
            notes.append(
                f"{gap.where}: {gap.steps} step(s) dropped (and {gap.untraced} the trace leaves out) from "
                f"{gap.start:.3f} s to {gap.end:.3f} s: the trace's writer process fell behind"
            )
        return notes


def stream_files(root: Path) -> dict[tuple[int, str], list[Path]]:
    """Every launch's files of every rank, by (rank, launch), oldest first: the highest
    rotation number first, the current file last."""
    found: dict[tuple[int, str], list[tuple[int, Path]]] = {}
    for path in root.iterdir():
        match = FILE_NAME.match(path.name)
        if match and path.is_file():
            rotation = int(match["rotation"]) if match["rotation"] else 0
            found.setdefault((int(match["rank"]), match["launch"] or ""), []).append((rotation, path))
    return {key: [p for _, p in sorted(files, reverse=True)] for key, files in sorted(found.items())}


def is_trace(folder: Path) -> bool:
    """Whether `folder` holds a served-step trace's files."""
    return folder.is_dir() and bool(stream_files(folder))


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
    if not _moment(header.get("started_at")):
        raise TraceError(
            f"{where}: started_at {header.get('started_at')!r} is not a UTC time like 2025-01-31T12:00:00.000000Z; "
            "a step's `at` counts from it: restore the header the recorder wrote"
        )
    timing = header.get("timing") or {}
    if timing.get("basis") != TIMING_BASIS:
        raise TraceError(
            f"{where}: timing basis {timing.get('basis')!r}; a table's steps are timed {TIMING_BASIS} "
            "(one update end to the next), so only such a trace can be held against one"
        )
    return header


def _moment(value) -> bool:
    try:
        datetime.fromisoformat(value)  # Python 3.11 reads the Z
    except (TypeError, ValueError):
        return False
    return True


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _dropped(record: dict, stream: int, where: str) -> Dropped:
    steps, untraced, start, end = (record.get(k) for k in (DROPPED, "untraced", "from", "to"))
    counts = all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (steps, untraced))
    seconds = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (start, end))
    if not counts or not seconds:
        raise TraceError(
            f"{where}: not a record of dropped steps ({DROPPED} and untraced counts, from and to seconds); the file "
            "was not written by the trace recorder, or was edited"
        )
    return Dropped(stream, steps, untraced, float(start), float(end), where)


def _read_file(path: Path, stream: Stream, trace: Trace, keep: Callable[[Step], None]) -> dict | None:
    """The file's header (None for an empty file); each of its steps handed to `keep` and its
    dropped records appended to the trace, line by line (a torn line is known to be the last
    once no line follows it)."""
    header, torn, first = None, None, ""  # torn: the line number of a line that is not JSON
    try:
        with path.open() as lines:
            for number, line in enumerate(lines, start=1):
                line = line.removesuffix("\n")
                if torn == 1:  # a first line that is not JSON, and more after it: not a trace
                    _header(path, first, stream.rank)
                if torn is not None:
                    raise TraceError(
                        f"{path}: line {torn} is not JSON, and is not the file's last line (a torn write can only "
                        "be the last); the file was edited or damaged"
                    )
                if number == 1:
                    if not _parses(line):  # died writing the header, or not a trace (if more follows)
                        first, torn = line, 1
                        continue
                    header = _header(path, line, stream.rank)
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    torn = number
                    continue
                where = f"{path}: line {number}"
                if isinstance(record, dict) and DROPPED in record and "step" not in record:
                    trace.dropped.append(_dropped(record, stream.index, where))
                    continue
                keep(parse_step(record, stream.rank, where, header["schema_version"], stream.index))
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
    found = stream_files(root)
    if not found:
        raise TraceError(
            f"{root}: no trace-dp<R>.jsonl here (nor trace-dp<R>-<launch>.jsonl); pass the folder the trace setting "
            "wrote (kvwarm_trace.out)"
        )
    trace = Trace(root, {}, {})
    for (rank, launch), paths in found.items():
        stream = Stream(len(trace.streams), rank, launch, paths)
        trace.streams.append(stream)
        for path in paths:
            header = _read_file(path, stream, trace, keep or trace.steps.append)
            trace.files.append(path)
            if header is None:
                continue
            first = stream.header = stream.header or header
            if header.get("started_at") != first.get("started_at"):
                raise TraceError(
                    f"{path}: from a run started at {header.get('started_at')}, the launch's other files at "
                    f"{first.get('started_at')}; keep one run's files in a trace folder, under their launch's name"
                )
        if stream.header:
            trace.headers.setdefault(rank, stream.header)
    if not trace.headers:
        raise TraceError(f"{root}: the trace files are empty (not even a header); the recorder never wrote")
    trace.header = trace.headers[min(trace.headers)]
    for stream in trace.streams:
        header = stream.header
        if header and (header.get("dp_size") != trace.header.get("dp_size") or not stream.rank < _dp(header)):
            raise TraceError(
                f"{stream.files[-1]}: rank {stream.rank}'s header says dp_size {header.get('dp_size')!r}, rank "
                f"{min(trace.headers)}'s {trace.header.get('dp_size')!r}; keep one deployment's files in a trace folder"
            )
    if not trace.step_count:
        torn = f" (only a torn line: {trace.torn[0]})" if trace.torn else ""
        raise TraceError(
            f"{root}: an empty trace: headers but no step recorded{torn}; serve requests with the trace on, "
            "then validate"
        )
    return trace


def _dp(header: dict) -> int:
    return int(header.get("dp_size") or 1)
