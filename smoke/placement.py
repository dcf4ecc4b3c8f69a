"""Where the served step's processes run (issue 61): the engine core (and, on the CPU engine,
its model worker) on cores of its own, the frontend (the API server, the trace's writer
process) on others, the load's client on the rest, as on a deployment; a table's sweep the
same way, so served and swept steps run on the same cores. What ran where is read back from
/proc and printed. benchmarks/_served/pinning.py pins the CPU host's served benchmark.

On a host of fewer than 4 cores the CPU engine's model worker gets the last core alone, as
the served benchmark's pinning has it: under vLLM's batch queue an engine core sharing the
worker's core takes each output late while the worker, the next step already queued, runs it
back to back: in the dry run a fifth of the served decode windows held no forward, and a
table's bias read +150 % (docs/measurements/served-vs-table.md, "The batch queue on two cores").

Processes are told apart by the tree, not by title (the GPU host's kit leaves setproctitle
out, so a forked engine core has its parent's command line): the launched process is the
frontend, the trace's writer and multiprocessing's resource tracker are frontend work, every
other descendant is the engine's. The model worker alone is told by vLLM's title; where
titles are missing it stays the engine's, which on a host of 4 or more cores is its place.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

FRONTEND_MARKS = (b"served/sink.py", b"resource_tracker")
WORKER_TITLE = b"::Worker"  # vLLM's title for an executor's worker process (VLLM::Worker_...)


def cores() -> dict[str, set[int]]:
    """{engine, worker, frontend, client: cores}: on a host of at least 4 cores, the engine
    (its core and any model worker) half of them, the frontend and the client a quarter each;
    on a smaller one the model worker the last core alone and the engine core, the frontend
    and the client sharing the rest (said in the placement)."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 4:
        rest = set(mine[:-1]) or set(mine)
        return {"engine": rest, "worker": {mine[-1]}, "frontend": rest, "client": rest}
    half, quarter = len(mine) // 2, len(mine) // 4
    return {
        "engine": set(mine[:half]),
        "worker": set(mine[:half]),
        "frontend": set(mine[half : half + quarter]),
        "client": set(mine[half + quarter :]),
    }


def _tree(root: int) -> dict[int, bytes]:
    """`root` and its live descendants, with their command lines."""
    parents, lines = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                lines[int(entry.name)] = (entry / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
    members, grown = {root} & set(lines), True
    while grown:
        children = {pid for pid, parent in parents.items() if parent in members} - members
        members |= children
        grown = bool(children)
    return {pid: lines[pid] for pid in members}


def roles(root: int) -> dict[int, str]:
    """{pid: engine | worker | frontend} of the tree under `root` (the launched frontend)."""

    def role(pid: int, line: bytes) -> str:
        if pid == root or any(m in line for m in FRONTEND_MARKS):
            return "frontend"
        return "worker" if WORKER_TITLE in line else "engine"

    return {pid: role(pid, line) for pid, line in _tree(root).items()}


def pin_tree(root: int, where: dict[str, set[int]]) -> None:
    """Every thread of the tree under `root` onto its role's cores (masks are per thread)."""
    for pid, role in roles(root).items():
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                os.sched_setaffinity(int(task.name), where[role])
            except OSError:  # gone meanwhile
                continue


class Pinner:
    """Keeps a process tree pinned while it lives (its engine starts threads and processes
    as it boots); `placement()` says where each of its processes may run."""

    def __init__(self, root: int, where: dict[str, set[int]], every: float = 2.0):
        self.root, self.where, self._stop = root, where, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            pin_tree(self.root, self.where)

    def stop(self) -> None:
        self._stop.set()

    def placement(self) -> list[str]:
        pin_tree(self.root, self.where)
        said = []
        for pid, role in sorted(roles(self.root).items()):
            try:
                allowed = next(
                    line.split(":", 1)[1].strip()
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("Cpus_allowed_list")
                )
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except (OSError, StopIteration):
                continue
            said.append(f"{role} {pid} ({name}): cores {allowed}")
        return said


def client_affinity(where: dict[str, set[int]]):
    """A preexec_fn that puts a child (the load's client) on the client's cores."""
    return lambda: os.sched_setaffinity(0, where["client"])


def words(where: dict[str, set[int]]) -> str:
    def span(cpus: set[int]) -> str:
        return f"{min(cpus)}-{max(cpus)}" if len(cpus) > 1 else str(min(cpus))

    shared = " (shared: fewer than 4 cores here)" if where["frontend"] == where["client"] else ""
    worker = f", model worker {span(where['worker'])} alone" if where["worker"] != where["engine"] else ""
    return (
        f"engine {span(where['engine'])}{worker}, frontend {span(where['frontend'])}, "
        f"client {span(where['client'])}{shared}"
    )
