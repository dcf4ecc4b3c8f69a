"""A sweep's cost per row as it grows (benchmarks/campaign_scale.py, tests/vllm/test_long_sweep.py):
each row's time, the engine thread's stalls at point boundaries, resident memory at each decile,
and the rows per minute per decile, the first and the last also against fresh sweeps of the
same points.

Why the fresh sweeps: the plan runs a rung per batch size, largest first, each deepest first, so
a table's later points cost other work than its first ones, and its raw rate moves along the
sweep whatever the sweep's own cost per row does. The first decile's points and the last
decile's are each swept again on their own, from fresh; a decile's time per row there over its
time per row in the long sweep is what stays flat when the cost per row does not grow (the
first decile's is about 1 by construction: both sweeps start fresh).

A stall: the longest single call into the scheduler (schedule() or update_from_output()) from
the moment the sweep takes a point's last timed step (its row, the collection between points,
the artifact's write, the exchange's share) to the schedule() that first schedules the next
point's requests (after the last point there is none: the sweep's end is no boundary). A
served engine runs none of its own requests inside such a call.
"""

from __future__ import annotations

import bisect
import itertools
import time
from pathlib import Path


def resident_mib() -> float:
    """This process's resident set (VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def ends(watch: Watch) -> tuple[list, list]:
    """The points of a long sweep's first and last decile, in the order it took them (one
    rank's watch: every rank measures every point)."""
    taken = [point for _, point in watch.rows]
    return taken[: len(taken) // 10], taken[len(taken) - len(taken) // 10 :]


class Watch:
    """One scheduler's schedule() and update_from_output() timed (instance attributes, which the
    engine core and the harness call), its sweep's rows as they come, (when, the point), and
    its artifact writer's writes, (when, seconds). A stall is kept with the part of it the
    writer's writes took (`stall_less_writes`: the longest such call without them, and
    `stall_cpu` the CPU time this thread spent in it: far less than its wall time is a
    thread kept waiting for a CPU by other processes, not work)."""

    def __init__(self, scheduler, sweep, writer=None):
        self.rows: list[tuple[float, tuple]] = []
        self.writes: list[tuple[float, float]] = []
        self.rss: dict[int, float] = {}  # rows done (every rank's): VmRSS then, at each decile's end
        self.stall = self.stall_less_writes = self.stall_cpu = 0.0  # the longest call at a point boundary
        self.boundary = 0.0  # the longest boundary, end to end
        self._from: float | None = None  # when the last point's row was taken
        self._longest = [0.0, 0.0, 0.0]  # the boundary now open: its longest call; without writes, and its CPU
        self._written = [0.0, 0.0]  # every write's seconds so far, and their CPU seconds
        self._deciles: set[int] = set()
        rows = sweep.rows
        schedule, update, after_update = scheduler.schedule, scheduler.update_from_output, sweep.after_update

        def note(seconds: float, cpu: float, before: list[float]) -> None:
            less = seconds - (self._written[0] - before[0])
            if less > self._longest[1]:
                self._longest[1:] = [less, cpu - (self._written[1] - before[1])]
            self._longest[0] = max(self._longest[0], seconds)

        def timed_schedule(*args, **kwargs):
            began, cpu, written = time.perf_counter(), time.thread_time(), list(self._written)
            output = schedule(*args, **kwargs)
            ended = time.perf_counter()
            if self._from is not None and sweep.done:  # the sweep's end: no boundary
                self._from = None
            if self._from is not None:
                note(ended - began, time.thread_time() - cpu, written)
                if output.total_num_scheduled_tokens:  # the next point's first step: the boundary closes
                    self.stall = max(self.stall, self._longest[0])
                    if self._longest[1] > self.stall_less_writes:
                        self.stall_less_writes, self.stall_cpu = self._longest[1:]
                    self.boundary = max(self.boundary, ended - self._from)
                    self._from = None
            return output

        def timed_after_update(*args, **kwargs):
            began, before = time.perf_counter(), len(rows)
            after_update(*args, **kwargs)
            if len(rows) > before:
                self._from, self._longest = began, [0.0, 0.0, 0.0]
                self.rows.append((began, (rows[-1].total_kv_read_tokens, rows[-1].batch_size)))

        def timed_update(*args, **kwargs):
            began, cpu, written = time.perf_counter(), time.thread_time(), list(self._written)
            at_boundary = self._from is not None
            outputs = update(*args, **kwargs)
            if self._from is not None:  # timed from the row where this call took it
                note(time.perf_counter() - (began if at_boundary else self._from), time.thread_time() - cpu, written)
            return outputs

        scheduler.schedule, scheduler.update_from_output = timed_schedule, timed_update
        sweep.after_update = timed_after_update
        if writer is not None:
            write = writer.write

            def timed_write(*args, **kwargs):
                began, cpu = time.perf_counter(), time.thread_time()
                write(*args, **kwargs)
                seconds = time.perf_counter() - began
                self.writes.append((began, seconds))
                self._written[0] += seconds
                self._written[1] += time.thread_time() - cpu

            writer.write = timed_write

    def note_memory(self, done: int, planned: int) -> None:
        """VmRSS at each decile's end of the `done` rows (every rank's; called between steps)."""
        decile = done * 10 // planned
        if decile not in self._deciles:
            self._deciles.add(decile)
            self.rss[done] = resident_mib()


def _per_row(watches: list[Watch], less_writes: bool = False) -> float:
    """A sweep's seconds per row, from its first row to its last (every rank's rows); with
    `less_writes`, less the artifact writer's writes between them."""
    times = sorted(at for w in watches for at, _ in w.rows)
    written = sum(s for w in watches for at, s in w.writes if times[0] <= at <= times[-1]) if less_writes else 0.0
    return (times[-1] - times[0] - written) / (len(times) - 1)


def figures(long: list[Watch], first: list[Watch], last: list[Watch]) -> dict:
    """The long sweep's rows per minute per decile (every rank's rows together) and their
    last/first ratio; the fresh sweeps' time per row of the first and the last decile's points
    over the long sweep's (`relative`) and its last/first ratio; the longest stall and
    boundary; the writer's longest write and share of each decile; VmRSS growth per 10,000
    rows after the first decile."""
    rows = sorted(r for w in long for r in w.rows)
    edges = [rows[0][0], *(rows[len(rows) * d // 10 - 1][0] for d in range(1, 11))]
    counts = [len(rows) * d // 10 - len(rows) * (d - 1) // 10 for d in range(1, 11)]
    counts[0] -= 1  # the first row opens the first decile's time
    per_row = [(b - a) / n for (a, b), n in zip(itertools.pairwise(edges), counts)]
    relative = [_per_row(first) / per_row[0], _per_row(last) / per_row[-1]]
    writes = sorted(w for watch in long for w in watch.writes if rows[0][0] <= w[0] <= rows[-1][0])
    written = [0.0] * 10
    for at, seconds in writes:
        written[min(9, bisect.bisect_left(edges, at, 1) - 1)] += seconds
    less = [t - w / n for t, w, n in ((per_row[0], written[0], counts[0]), (per_row[-1], written[-1], counts[-1]))]
    relative_less = [_per_row(first, True) / less[0], _per_row(last, True) / less[1]]
    rss = long[0].rss  # one process: every rank's memory, by every rank's rows
    low, high = min(r for r in rss if r >= len(rows) // 10), max(rss)
    return {
        "rows": len(rows),
        "seconds": rows[-1][0] - rows[0][0],
        "rates": [60 / t for t in per_row],
        "ratio": per_row[0] / per_row[-1],
        "relative": relative,
        "relative_ratio": relative[1] / relative[0],
        "relative_less_writes": relative_less,
        "relative_less_writes_ratio": relative_less[1] / relative_less[0],
        "stall_ms": max(w.stall for w in long) * 1e3,
        "stall_less_writes_ms": max(w.stall_less_writes for w in long) * 1e3,
        "stall_cpu_ms": max(long, key=lambda w: w.stall_less_writes).stall_cpu * 1e3,
        "boundary_ms": max(w.boundary for w in long) * 1e3,
        "longest_write_ms": max((seconds for _, seconds in writes), default=0.0) * 1e3,
        "write_share": [w / (b - a) for w, (a, b) in zip(written, itertools.pairwise(edges))],
        "rss_mib": (rss[low], rss[high]),
        "mib_per_10k_rows": (rss[high] - rss[low]) / (high - low) * 10_000 if high > low else 0.0,
    }


def lines(name: str, side: dict) -> list[str]:
    """What a benchmark or a test prints of `figures`."""
    low, high = side["rss_mib"]
    rates = " ".join(f"{r:.0f}" for r in side["rates"])
    first, last = side["relative"]
    shares = " ".join(f"{100 * w:.1f}%" for w in side["write_share"])
    return [
        f"{name}: {side['rows']} rows in {side['seconds']:.0f} s",
        f"  rows/min per decile: {rates}; last/first {side['ratio']:.2f}",
        f"  fresh over this sweep's time per row: first decile {first:.2f}, last {last:.2f}; "
        + f"last/first {side['relative_ratio']:.2f}; without the artifact writer's writes "
        + f"{side['relative_less_writes'][0]:.2f} and {side['relative_less_writes'][1]:.2f}, "
        + f"last/first {side['relative_less_writes_ratio']:.2f}",
        f"  longest stall at a point boundary {side['stall_ms']:.1f} ms; without the artifact writer's writes "
        + f"{side['stall_less_writes_ms']:.1f} ms (on this thread's CPU {side['stall_cpu_ms']:.1f} ms); longest "
        + f"boundary {side['boundary_ms']:.1f} ms",
        f"  the artifact writer: longest write {side['longest_write_ms']:.1f} ms; per decile {shares}",
        f"  VmRSS {low:.0f} -> {high:.0f} MiB after the first decile: {side['mib_per_10k_rows']:.1f} MiB/10k rows",
    ]
