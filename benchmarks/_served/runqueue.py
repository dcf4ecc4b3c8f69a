"""How long the engine's processes waited for a CPU while they could run, over a window: the
kernel's /proc/<pid>/task/<tid>/schedstat (time on a CPU, time runnable on a run queue), summed
over each process's threads. A served engine core shares its cores with the API server and
the client; a swept one shares them with nobody. Where the served step is slower than the
table's, the engine core's run-queue share on each side tells whether the difference is
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
        self.first: dict[tuple, tuple[int, int]] = {}
        self.last: dict[tuple, tuple[int, int]] = {}
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
                    on_cpu, waiting, _ = (int(x) for x in (task / "schedstat").read_text().split())
                except (OSError, ValueError):
                    continue
                key = (role, pid, task.name)
                self.first.setdefault(key, (on_cpu, waiting))
                self.last[key] = (on_cpu, waiting)

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

    def figures(self) -> dict[str, dict[str, float]]:
        """Per role: ms on a CPU, ms waiting for one, and the waiting share of the two (%)."""
        out = {}
        for role in (ENGINE_CORE, WORKER):
            keys = [k for k in self.last if k[0] == role]
            if not keys:
                continue
            on_cpu = sum(self.last[k][0] - self.first[k][0] for k in keys) / 1e6
            waiting = sum(self.last[k][1] - self.first[k][1] for k in keys) / 1e6
            total = on_cpu + waiting
            out[role] = {
                "on_cpu_ms": round(on_cpu, 1),
                "waiting_ms": round(waiting, 1),
                "waiting_pct": round(100 * waiting / total, 2) if total else None,
            }
        return out


def in_words(figures: dict[str, dict[str, float]]) -> str:
    return (
        "; ".join(
            f"{role.replace('_', ' ')} {f['on_cpu_ms']:.0f} ms on a CPU, waited {f['waiting_ms']:.0f} ms for one "
            f"({f['waiting_pct']}%)"
            for role, f in figures.items()
        )
        or "no engine process seen"
    )
