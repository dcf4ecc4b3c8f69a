"""The host's own speed at the moments the benchmark compares: a fixed matrix product (about
a tiny model's step of compute) timed on the worker's core at the engine's priority, just
before and just after the served run and each table (the first third of the products left
out: this host runs a core slower for about 100 ms after a pause). A table and a trace are
comparable only where the host ran at one speed for both: a shared host can slow one of them
by 20-35 % for minutes (seen here, docs/measurements/served-vs-table.md), which no repeat inside either run
shows. The spread of these floors is printed beside the figures and in the JSON line.
"""

from __future__ import annotations

import os
import subprocess
import sys

from .pinning import PRIORITY, cores

PROBE = """
import statistics, time, torch
torch.set_num_threads(1)
a, b = torch.randn(384, 384), torch.randn(384, 384)
times = []
for _ in range(450):
    started = time.perf_counter()
    torch.mm(a, b)
    times.append(time.perf_counter() - started)
print(statistics.median(times[150:]) * 1e3)  # past the host's slow start after a pause
"""


def _placed(cpus: set[int]):
    def place() -> None:
        os.sched_setaffinity(0, cpus)
        try:
            os.setpriority(os.PRIO_PROCESS, 0, PRIORITY)
        except OSError:  # not permitted: the probe runs at the default priority
            pass

    return place


def floor_ms() -> float:
    """The probe's median, in ms, on the worker's core (every core where there is one)."""
    _, worker = cores()
    cpus = {worker} if worker is not None else set(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, preexec_fn=_placed(cpus)
    )
    return float(done.stdout.strip().splitlines()[-1])


def spread(values) -> float | None:
    """How far apart the values are (floors, a row's medians): the slowest over the fastest,
    less one, in percent; None for fewer than two."""
    values = list(values)
    return round(100 * (max(values) / min(values) - 1), 2) if len(values) > 1 else None
