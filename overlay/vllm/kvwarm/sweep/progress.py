"""A sweep's progress on long work: planned and done rows, the rate and the time left.

In the engine's process (sweep.run; under `vllm serve` the only place it is seen) a point's
line is logged at most once per LOG_SECONDS, the first point's at once: a sweep of tens of
thousands of points does not write a line per point to a server's log. The rungs' lines and
the sweep's last line are logged as they come.

The sweep command shows a progress bar (tqdm, a vLLM requirement) where its standard error
is a terminal, and leaves the engine's paced lines alone otherwise (a file, a pipe, CI). It
counts the rows of the run it steps in its own process, or, where the engine runs in
processes of its own, of the running artifact (the combined view under data parallel), read
at a pace that keeps the reading within READ_SHARE of the time however large it grows.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from ..record import vocabulary as v
from .pacing import Pacing

LOG_SECONDS = 30.0  # at most one point line per this many seconds
READ_SHARE = 0.05  # the command's reading of a running artifact: at most this share of its time


def rate_line(done: int, planned: int, seconds: float, measured: int | None = None) -> str:
    """Done and planned rows, the rate since the start and the time left at that rate;
    `measured`: the rows of `done` measured in those seconds (default: all of them; fewer on a
    resumed sweep, whose earlier rows took no time here)."""
    measured = done if measured is None else measured
    rate = measured / seconds * 60 if seconds > 0 else 0.0
    return f"{done}/{planned} rows, {rate:.0f} rows/min" + time_left(done, planned, measured, seconds)


def time_left(done: int, planned: int, measured: int, seconds: float) -> str:
    """ ", about <time> left" at the rate of `measured` rows in `seconds` ("" where the sweep
    is done or no rate is known yet)."""
    if not (0 < done < planned and measured > 0 and seconds > 0):
        return ""
    return f", about {duration((planned - done) * seconds / measured)} left"


def duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


class PointLog:
    """A point's line at most once per `every` seconds (the first at once), with the rate."""

    def __init__(self, say: Callable[[str], None], every: float | None = None, clock=time.monotonic):
        self._say, self.every, self.clock = say, LOG_SECONDS if every is None else every, clock
        self.started = clock()
        self.quiet = False  # the command shows a bar instead
        self._last: float | None = None
        self._before: int | None = None  # rows done before the first this log saw (an earlier boot's)

    def row(self, row, done: int, planned: int) -> None:
        now = self.clock()
        if self._before is None:
            self._before = done - 1
        if self.quiet or (self._last is not None and now - self._last < self.every):
            return
        self._last = now
        median = f"{row.median_seconds * 1e3:.2f} ms" if row.median_seconds is not None else row.kv_seed_regime
        self._say(
            f"point {done}/{planned} K={row.total_kv_read_tokens} B={row.batch_size} ({row.kv_seed_regime}"
            f"{f', {row.ab} side' if row.ab else ''}): "
            f"{median}; {rate_line(done, planned, now - self.started, done - self._before)}"
        )


class Bar:
    """The command's progress bar over the sweep's rows (tqdm, on standard error)."""

    def __init__(self):
        from tqdm import tqdm

        self._bar = tqdm(total=0, unit="row", dynamic_ncols=True, desc="kvwarm sweep")

    @staticmethod
    def wanted(stream) -> bool:
        """Whether `stream` is a terminal: elsewhere the engine's paced lines say it."""
        try:
            return os.isatty(stream.fileno())
        except (AttributeError, OSError, ValueError):  # no file behind it (a test's capture)
            return False

    def show(self, done: int, planned: int) -> None:
        bar = self._bar
        bar.total = planned  # drawn with the next update
        if done > bar.n:
            bar.update(done - bar.n)

    def close(self) -> None:
        self._bar.close()


class ArtifactRows:
    """The rows of a running artifact another process writes (a rank's, or the combined view),
    read no more than READ_SHARE of the time; `planned`: the rows planned where the command
    knows them (a points file), else the grid's points once the artifact records them.
    `share`: of the time, what reading it may take at most (1: read at every call)."""

    def __init__(self, path: Path, planned: int | None, ranks: int = 1, share: float = READ_SHARE):
        self.path, self.planned, self.ranks = path, planned, ranks
        self.status: str | None = None
        self.done = 0
        self._pacing = Pacing(share)

    def read(self) -> None:
        if not self._pacing.due():
            return
        began = self._pacing.clock()
        try:
            artifact = json.loads(self.path.read_text())
        except (OSError, ValueError):  # not written yet, or being replaced
            return
        finally:
            self._pacing.wrote(began)
        self.status = artifact.get("status")
        ranks = artifact.get("ranks")
        measured = sum(r.get("rows", 0) for r in ranks) if ranks else len(artifact.get("results", []))
        self.done = measured + len(artifact.get("skipped_points", []))
        grid = (artifact.get("kvwarm") or {}).get("grid") or {}
        if self.planned is None and grid.get("points"):
            self.planned = grid["points"] * self.ranks

    @property
    def final(self) -> bool:
        return self.status in (v.COMPLETE, v.FAILED)
