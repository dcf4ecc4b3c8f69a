"""The scheduler adapter (`--scheduler-cls vllm.kvwarm.scheduler.KvWarmScheduler`, or
`KvWarmAsyncScheduler` with async scheduling): stock scheduling, plus the admission of
queued shadows at the end of each `schedule()`. Everything else lives in plain objects
(ShadowInjector) that tests drive against a real scheduler without an engine.

With nothing queued it schedules exactly as the class it extends.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from .injection import ShadowInjector


class KvWarmSchedulerMixin:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kvwarm = ShadowInjector()

    def schedule(self, *args, **kwargs):  # vLLM passes e.g. throttle_prefills
        output = super().schedule(*args, **kwargs)
        if self.kvwarm.has_pending():
            self.kvwarm.admit_pending(self, output)
        return output

    def has_requests(self) -> bool:
        # Queued shadows need a schedule() call even when nothing else is waiting
        # (parked chains are not in `running`); without this the engine never steps.
        return super().has_requests() or self.kvwarm.has_pending()


class KvWarmScheduler(KvWarmSchedulerMixin, Scheduler):
    pass


class KvWarmAsyncScheduler(KvWarmSchedulerMixin, AsyncScheduler):
    pass
