"""Where the served benchmark's processes run, the same for the served engine and the tables.

vLLM's CPU platform runs the model in a worker process of its own whenever the engine core
runs in a process of its own (it turns the "uni" executor into "mp"), so a served step is the
engine core handing the step to the worker and waiting for its output. Both sides therefore
use the mp executor (serving.engine_args), and both are pinned alike, as a host that gives the
model's worker cores of its own: every thread of the executor's worker process on the last
core alone; everything else (the API server, the engine core, which waits on the worker's
queue, the client; or the sweep command) on the other cores. The worker's OpenMP thread is
bound there by vLLM too (VLLM_CPU_OMP_THREADS_BIND=<that core>). The worker and the engine
core also run at a higher priority (nice -10, where permitted) on both sides: the API server
and the client share the engine core's core here, and on a real host they would not delay it;
it also keeps other jobs on a shared host from taking the engine's cores. Affinity masks
and priorities are per thread, so they are set per thread once the worker exists; what ran
where is read back from /proc and printed. Unpinned: nobody is pinned or raised
(VLLM_CPU_OMP_THREADS_BIND=nobind).

Pinning the engine core together with its worker on one core (this benchmark's first way)
made the served forward 1.3-1.4x the table's: the engine core's wait for the worker took the
worker's core (docs/measurements/served-vs-table.md, "Served steps against tables").
"""

from __future__ import annotations

import os
from pathlib import Path

from kvwarm_testing.multi_rank import session_processes

WORKER_TITLE = b"::Worker"  # vLLM's title for an executor worker process (VLLM::Worker...)
ENGINE_CORE_TITLE = b"::EngineCore"
PRIORITY = -10  # the engine's processes ahead of the rest of the host: as on cores of their own


def cores() -> tuple[set[int], int | None]:
    """(the cores the rest runs on, the worker's core) when pinned; None where one core is all."""
    mine = sorted(os.sched_getaffinity(0))
    return (set(mine[:-1]), mine[-1]) if len(mine) > 1 else (set(mine), None)


def pinning_env(pinned: bool) -> dict[str, str]:
    _, worker = cores()
    return {"VLLM_CPU_OMP_THREADS_BIND": str(worker) if pinned and worker is not None else "nobind"}


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (an affinity mask is per thread)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except OSError:  # gone meanwhile
            continue


def raise_priority(pid: int) -> None:
    """Every thread of process `pid` at PRIORITY, where this user may (else left as it is)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.setpriority(os.PRIO_PROCESS, int(task.name), PRIORITY)
        except OSError:  # gone meanwhile, or not permitted
            continue


def pin_session(sid: int, engine_core: int | None = None) -> bool:
    """The worker processes of session `sid` on the worker's core, the rest elsewhere, the
    workers and the engine core (its title's, or `engine_core` where it runs in a command's own
    process) ahead of the rest; False while no worker process exists yet (nothing is moved)."""
    rest, worker = cores()
    processes = session_processes(sid)
    workers = {pid for pid, cmdline in processes.items() if WORKER_TITLE in cmdline}
    if not workers or worker is None:
        return False
    for pid, cmdline in processes.items():
        pin_threads(pid, {worker} if pid in workers else rest)
        if pid in workers or pid == engine_core or ENGINE_CORE_TITLE in cmdline:
            raise_priority(pid)
    return True


def thread_cores(pid: int) -> dict[str, str]:
    """Each thread name of a process with the cores it may run on (/proc)."""
    found: dict[str, set[str]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            allowed = next(
                line.split(":", 1)[1].strip()
                for line in (task / "status").read_text().splitlines()
                if line.startswith("Cpus_allowed_list")
            )
        except (OSError, StopIteration):
            continue
        found.setdefault(allowed, set()).add(name)
    return {cpus: ", ".join(sorted(names)[:6]) + (" ..." if len(names) > 6 else "") for cpus, names in found.items()}


def placement(sid: int) -> str:
    """Where each process of session `sid` may run, thread by thread, in words."""
    said = []
    for pid, cmdline in sorted(session_processes(sid).items()):
        title = cmdline.split(b"\0")[0].decode(errors="replace").rsplit("/", 1)[-1][:40]
        try:
            nice = os.getpriority(os.PRIO_PROCESS, pid)
        except OSError:
            continue
        said.append(f"{title} (nice {nice}): " + "; ".join(f"[{c}] {n}" for c, n in thread_cores(pid).items()))
    return " | ".join(said)
