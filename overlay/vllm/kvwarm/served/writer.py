"""The trace's files and the thread that writes them, so that a step never formats or
writes anything: the engine's thread appends a tuple of references to a queue (`submit`);
a daemon thread wakes every FLUSH_SECONDS, turns each into a JSON line (`render`, which may
say None: nothing to write), writes it to a buffered file and flushes once per wake-up. It
hands the GIL back after every line, so the engine's thread never waits behind a whole
batch of formatting: with os.sched_yield(), which lets go of the GIL and the core for a
thread that waits for either; time.sleep(0) did the same at about 20 times the CPU on a
virtual host (it arms a timer: docs/measurements.md).

Bounded: at most MAX_PENDING items wait; beyond that an item is dropped and counted (the
steps' numbers then skip, and the count is logged at the end). Each file is rotated once it
would pass the size cap: trace-dp<R>.jsonl becomes trace-dp<R>.1.jsonl, .1 becomes .2 and so
on, the oldest beyond the files kept removed; every file starts with the header. A rank's
files of an earlier run in the same folder are removed when the trace starts (a folder holds
one run per rank). Nothing here reaches the engine: a write that fails is logged once and the
trace stops; a line that cannot be rendered is logged once and skipped.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

from vllm.logger import init_logger

from ..record import vocabulary as v

logger = init_logger(__name__)

FLUSH_SECONDS = 0.2
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # made once: json.dumps makes one per call
MAX_PENDING = 100_000  # items waiting for the thread (about 20 s of steps at 5,000 steps/s)


def line(record: dict) -> str:
    return _ENCODE(record) + "\n"


class TraceFiles:
    """One rank's trace files: the current one open, the rotated ones behind it."""

    def __init__(self, folder: Path, rank: int, header: dict, max_file_bytes: int, files: int):
        self.folder, self.rank = folder, rank
        self._header, self._max, self._keep = line(header), max_file_bytes, files
        try:
            folder.mkdir(parents=True, exist_ok=True)
            pattern = re.compile(rf"^trace-dp{rank}(\.\d+)?\.jsonl$")
            for old in folder.iterdir():
                if pattern.match(old.name):
                    old.unlink()
            self._open()
        except OSError as err:
            raise OSError(
                f"the trace folder {folder} cannot be written ({err}); give kvwarm_trace an 'out' folder this "
                "process may create and write"
            ) from err

    @property
    def path(self) -> Path:
        return self.folder / v.trace_file_name(self.rank)

    def _open(self) -> None:
        self._file = self.path.open("w", encoding="ascii", buffering=1 << 16)
        self._file.write(self._header)
        self._size = len(self._header)

    def write(self, text: str) -> None:
        if self._size + len(text) > self._max and self._size > len(self._header):
            self._rotate()
        self._file.write(text)
        self._size += len(text)

    def _rotate(self) -> None:
        self._file.close()
        name = v.trace_file_name
        (self.folder / name(self.rank, self._keep - 1)).unlink(missing_ok=True)
        for k in range(self._keep - 2, 0, -1):
            older = self.folder / name(self.rank, k)
            if older.exists():
                older.replace(self.folder / name(self.rank, k + 1))
        if self._keep > 1:
            self.path.replace(self.folder / name(self.rank, 1))
        self._open()

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TraceWriter:
    def __init__(self, files: TraceFiles, render: Callable[[object], str | None]):
        self._files, self._render = files, render
        self._pending: deque = deque()
        self.dropped = 0
        self.written = 0
        self._broken = False
        self._render_failed = False
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvwarm-trace-dp{files.rank}", daemon=True)
        self._thread.start()

    def submit(self, item) -> None:
        """From the engine's thread: never blocks, never raises."""
        if len(self._pending) >= MAX_PENDING:
            self.dropped += 1
            return
        self._pending.append(item)

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_SECONDS):
            self._drain()
        self._drain()

    def _drain(self) -> None:
        pending, wrote = self._pending, False
        while pending:
            item = pending.popleft()
            try:
                text = self._render(item)
            except Exception:  # a bug here must never reach the engine
                if not self._render_failed:
                    logger.exception("[kvwarm trace] a step could not be rendered; it is left out")
                    self._render_failed = True
                continue
            if text is not None and not self._broken:
                try:
                    self._files.write(text)
                    self.written += 1
                    wrote = True
                except OSError as err:
                    self._fail(err)
            os.sched_yield()  # the GIL back to the engine's thread between lines
        if wrote and not self._broken:
            try:
                self._files.flush()
            except OSError as err:
                self._fail(err)

    def _fail(self, err: OSError) -> None:
        self._broken = True
        logger.error(
            "[kvwarm trace] writing %s failed (%s); the trace stops here, the engine serves on", self._files.path, err
        )

    def close(self, timeout: float = 10.0) -> None:
        """Write what is pending and close the file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error(
                "[kvwarm trace] the writer did not finish within %.0f s; %d step(s) not written",
                timeout,
                len(self._pending),
            )
            return
        try:
            self._files.close()
        except OSError as err:
            self._fail(err)
        if self.dropped:
            logger.warning(
                "[kvwarm trace] %d step(s) dropped: more than %d waited for the writer", self.dropped, MAX_PENDING
            )
