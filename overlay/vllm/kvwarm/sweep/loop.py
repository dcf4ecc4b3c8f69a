"""The engine loop a sweep runs under, and the adapter class that serves it.

vLLM settles `scheduler_config.async_scheduling` when it makes the engine's config
(VllmConfig.__post_init__: unset means on unless an option rules it out, then the platform
has the last word; the CPU platform turns it off). The engine core then steps through
EngineCore.step (schedule, forward, update_from_output, one step at a time) or, with async
scheduling on, through EngineCore.step_with_batch_queue over `max_concurrent_batches` steps
(two): step n+1 is scheduled and submitted before step n's output is taken in. The async
adapter serves that loop (vLLM's AsyncScheduler schedules a request again while its last
step is in flight); the sync adapter serves the other.
"""

from __future__ import annotations

SYNC_ADAPTER = "vllm.kvwarm.scheduler.KvWarmScheduler"
ASYNC_ADAPTER = "vllm.kvwarm.scheduler.KvWarmAsyncScheduler"


def adapter_for(vllm_config) -> str:
    """The adapter (its qualified class name) for the async scheduling vLLM resolved in
    `vllm_config`."""
    return ASYNC_ADAPTER if vllm_config.scheduler_config.async_scheduling else SYNC_ADAPTER
