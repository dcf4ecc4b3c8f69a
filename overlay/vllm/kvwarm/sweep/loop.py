"""The engine loop a sweep runs under, and the adapter class that serves it.

vLLM settles `scheduler_config.async_scheduling` when it makes the engine's config
(VllmConfig.__post_init__: unset means on unless an option rules it out, then the platform
has the last word; the CPU platform turns it off). The engine core then steps through
EngineCore.step (schedule, forward, update_from_output, one step at a time) or, with async
scheduling on, through EngineCore.step_with_batch_queue over `max_concurrent_batches` steps
(two): step n+1 is scheduled and submitted before step n's output is taken in. The async
adapter serves that loop (vLLM's AsyncScheduler schedules a request again while its last
step is in flight); the sync adapter serves the other.

Under the batch queue a decode point's requests run one untimed step after the timed ones
(trailing_steps; sweep.decode_steps says why). The artifact records the loop (loop_record).
"""

from __future__ import annotations

from ..record import vocabulary as v

SYNC_ADAPTER = "vllm.kvwarm.scheduler.KvWarmScheduler"
ASYNC_ADAPTER = "vllm.kvwarm.scheduler.KvWarmAsyncScheduler"


def adapter_for(vllm_config) -> str:
    """The adapter (its qualified class name) for the async scheduling vLLM resolved in
    `vllm_config`."""
    return ASYNC_ADAPTER if vllm_config.scheduler_config.async_scheduling else SYNC_ADAPTER


def batch_queue_size(vllm_config) -> int:
    """How many steps the engine core keeps in flight: vLLM's max_concurrent_batches (two
    under async scheduling, else the pipeline stages); above one it steps a batch queue."""
    return int(vllm_config.max_concurrent_batches)


def engine_loop(vllm_config) -> str:
    """The loop the engine core steps: one step at a time, or vLLM's batch queue."""
    return v.LOOP_BATCH_QUEUE if batch_queue_size(vllm_config) > 1 else v.LOOP_SYNC


def trailing_steps(vllm_config) -> int:
    """Untimed decode steps after a point's timed ones (SweepConfig.trailing_steps)."""
    return 1 if engine_loop(vllm_config) == v.LOOP_BATCH_QUEUE else 0


def loop_record(scheduler) -> dict:
    """The artifact's record of the loop a sweep ran under and the adapter that served it."""
    vllm_config, cls = scheduler.vllm_config, type(scheduler)
    return {
        "loop": engine_loop(vllm_config),
        "scheduler_cls": f"{cls.__module__}.{cls.__qualname__}",
        "async_scheduling": bool(vllm_config.scheduler_config.async_scheduling),
        "batch_queue_size": batch_queue_size(vllm_config),
    }
