"""The collector held still in the executor's worker processes too: under tensor parallel
vLLM's MultiprocExecutor runs each rank's forward in a process of its own, whose collector
the scheduler's hold (sweep.gc_hold) never touches.

Each action of the hold (freeze, hold, release, end) runs in every worker through the
executor's `collective_rpc`, vLLM's own path to its workers (a module-level function is sent
by reference and called with the worker); a worker keeps a GcHold of its own for the sweep.
The scheduler reaches the executor through a hook in EngineCore.__init__
(`scheduler.kvwarm_executor`, docs/hooks.md). A worker in the scheduler's own process (one
rank: UniProcExecutor) is held with it, so nothing is done there; without the hook, or when
an action fails, the workers are recorded as not reached and the sweep carries on.
"""

from __future__ import annotations

import os

from vllm.logger import init_logger

from .gc_hold import GcHold

logger = init_logger(__name__)

HELD_WITH_SCHEDULER = "in_scheduler_process"  # the workers' policy: they run in the scheduler's process
UNREACHED = "unreached"

_HOLD: GcHold | None = None  # a worker process's hold, for the sweep that runs now


def run_in_worker(worker, action: str, scheduler_pid: int) -> dict:
    """In a worker process (through collective_rpc): the hold's `action` there, and what it
    has done so far."""
    global _HOLD
    if os.getpid() == scheduler_pid:
        return {"pid": scheduler_pid, "process": "scheduler"}
    hold = _HOLD = _HOLD or GcHold()
    getattr(hold, action)()
    if action == "end":
        _HOLD = None  # a later sweep in this process starts from the engine's policy
    return {"pid": os.getpid(), "process": "worker", **hold.record()}


class WorkerHold:
    """The scheduler's side: sends each action to every worker, keeps their last replies."""

    def __init__(self, executor):
        self._executor = executor
        self._pid = os.getpid()
        self._replies: list[dict] = []
        self._problem: str | None = (
            None
            if executor is not None
            else ("the scheduler holds no executor (a build without the hook in EngineCore.__init__, or no engine)")
        )

    def run(self, action: str) -> None:
        if self._problem is not None:
            return
        try:
            self._replies = list(self._executor.collective_rpc(run_in_worker, args=(action, self._pid)))
        except Exception as err:  # noqa: BLE001  (the workers' collector is recorded, never the sweep's end)
            self._problem = f"{action} failed: {type(err).__name__}: {err}"
            logger.warning("[kvwarm sweep] the workers' collector: %s", self._problem)

    def record(self) -> dict:
        if self._problem is not None:
            return {"policy": UNREACHED, "detail": self._problem}
        if not self._replies:
            return {"policy": UNREACHED, "detail": "no action was sent: the sweep held nothing"}
        workers = [r for r in self._replies if r.get("process") == "worker"]
        if not workers:
            return {"policy": HELD_WITH_SCHEDULER, "processes": 0}
        return {
            "policy": workers[0]["policy"],
            "processes": len(workers),
            "pids": [r["pid"] for r in workers],
            "collections_between_points": [r["collections_between_points"] for r in workers],
            "engine_froze_heap": [r["engine_froze_heap"] for r in workers],
            "heap_at_end": [r["heap_at_end"] for r in workers],
        }


def worker_hold(scheduler) -> WorkerHold:
    """The workers of the engine this scheduler runs in."""
    return WorkerHold(getattr(scheduler, "kvwarm_executor", None))
