"""How long the engine's processes waited for a CPU while they could run, over a window: the
kernel's /proc/<pid>/task/<tid>/schedstat (time on a CPU, time runnable on a run queue, times
put on a CPU), summed over each process's threads, and for its main thread alone: the engine
core's main thread runs the step loop and the worker's the forward, so their waits lie on the
step's path, while an output or a queue thread's may not. A main thread that sleeps on the
other side each step is woken at least once a step, so its wait per wake (the run-queue time
over the times it was put on a CPU) is what a step waits for a CPU each time it goes on, with
no step count needed: comparable between a served run and a sweep. A served engine core
shares its cores with the API server and the client; a swept one shares them with nobody.
Where the served step is slower than the table's, these figures tell whether the difference is
waiting for a CPU (contention of this host) rather than work the table leaves out (issue 40).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Self

from kvwarm_testing.multi_rank import session_processes

from .pinning import ENGINE_CORE_TITLE, WORKER_TITLE

ENGINE_CORE, WORKER = "engine_core", "worker"
POLL_SECONDS = 0.2  # threads that come and go between polls are missed, not miscounted


class RunQueue:
    """`with RunQueue(sid) as waits:` samples the engine core's and the workers' threads of
    session `sid` (or `engine_core`, the pid where the engine core runs in a command's own
    process) until the block ends; `waits.figures()` then gives each role's totals."""

    def __init__(self, sid: int, engine_core: int | None = None):
        self.sid, self.engine_core = sid, engine_core
        self.first: dict[tuple, tuple[int, int, int]] = {}
        self.last: dict[tuple, tuple[int, int, int]] = {}
        self.roles: dict[int, str] = {}  # pid -> role, once found
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, daemon=True)

    def _role(self, pid: int, cmdline: bytes) -> str | None:
        if WORKER_TITLE in cmdline:
            return WORKER
        return ENGINE_CORE if pid == self.engine_core or ENGINE_CORE_TITLE in cmdline else None

    def _processes(self) -> dict[int, str]:
        """The engine's processes by role: /proc is scanned (every process, a few ms) only
        until both roles are found, so that the poll does not load the cores it measures."""
        if set(self.roles.values()) != {ENGINE_CORE, WORKER}:
            found = ((pid, self._role(pid, cmdline)) for pid, cmdline in session_processes(self.sid).items())
            self.roles = {pid: role for pid, role in found if role is not None}
        return self.roles

    def sample(self) -> None:
        for pid, role in self._processes().items():
            try:
                tasks = list(Path(f"/proc/{pid}/task").iterdir())
            except OSError:  # gone meanwhile
                continue
            for task in tasks:
                try:
                    on_cpu, waiting, slices = (int(x) for x in (task / "schedstat").read_text().split())
                except (OSError, ValueError):
                    continue
                key = (role, pid, task.name)
                self.first.setdefault(key, (on_cpu, waiting, slices))
                self.last[key] = (on_cpu, waiting, slices)

    def _poll(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self.sample()

    def __enter__(self) -> Self:
        self.sample()
        self._poller.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._poller.join()
        self.sample()

    def _delta(self, keys: list[tuple]) -> tuple[int, ...]:
        return tuple(sum(self.last[k][i] - self.first[k][i] for k in keys) for i in range(3))

    def figures(self) -> dict[str, dict[str, float]]:
        """Per role: ms on a CPU, ms waiting for one, the waiting share of the two (%); and for
        the main thread, its waiting share and its wait per time put on a CPU (us)."""
        out = {}
        for role in (ENGINE_CORE, WORKER):
            keys = [k for k in self.last if k[0] == role]
            if not keys:
                continue
            on_cpu, waiting, _ = self._delta(keys)
            main_on_cpu, main_waiting, main_slices = self._delta([k for k in keys if k[2] == str(k[1])])
            out[role] = {
                "on_cpu_ms": round(on_cpu / 1e6, 1),
                "waiting_ms": round(waiting / 1e6, 1),
                "waiting_pct": share(waiting, on_cpu),
                "main_waiting_pct": share(main_waiting, main_on_cpu),
                "main_wait_per_wake_us": round(main_waiting / main_slices / 1e3, 1) if main_slices else None,
            }
        return out


def share(waiting: int, on_cpu: int) -> float | None:
    return round(100 * waiting / (on_cpu + waiting), 2) if on_cpu + waiting else None


def in_words(figures: dict[str, dict[str, float]]) -> str:
    return (
        "; ".join(
            f"{role.replace('_', ' ')} {f['on_cpu_ms']:.0f} ms on a CPU, waited {f['waiting_ms']:.0f} ms for one "
            f"({f['waiting_pct']}%; its main thread {f['main_waiting_pct']}%, {f['main_wait_per_wake_us']} us a wake)"
            for role, f in figures.items()
        )
        or "no engine process seen"
    )
