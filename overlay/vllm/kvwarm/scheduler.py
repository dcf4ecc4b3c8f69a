"""The scheduler adapter (`--scheduler-cls vllm.kvwarm.scheduler.KvWarmScheduler`, or
`KvWarmAsyncScheduler` with async scheduling): stock scheduling, plus the admission of
queued shadows at the end of each `schedule()`. Everything else lives in plain objects
(ShadowInjector) that tests drive against a real scheduler without an engine.

With nothing queued it schedules exactly as the class it extends. With
additional_config {"kvwarm_sweep": {"points": FILE, "out": DIR}} it runs a decode sweep
(sweep_run.SweepRun) from its first step, in whichever process the scheduler lives.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from .injection import ShadowInjector
from .sweep_run import CONFIG_KEY, SweepRun


class KvWarmSchedulerMixin:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kvwarm = ShadowInjector()
        self.kvwarm_sweep = None  # a sweep.DecodeSweep while one runs
        self.kvwarm_run = None  # the SweepRun that owns it, when configured
        additional = self.vllm_config.additional_config
        spec = additional.get(CONFIG_KEY) if isinstance(additional, dict) else None
        if spec is not None:
            self.kvwarm_run = SweepRun(self, spec)
            self.kvwarm_sweep = self.kvwarm_run.sweep

    def _drive(self, hook, *args) -> None:
        """Run a sweep hook; a failure is recorded in the artifact before it propagates."""
        try:
            hook(self, *args)
        except BaseException as err:
            if self.kvwarm_run is not None:
                self.kvwarm_run.fail(err)
            raise

    def schedule(self, *args, **kwargs):  # vLLM passes e.g. throttle_prefills
        sweep = self.kvwarm_sweep
        if sweep is not None and not sweep.done:
            self._drive(sweep.before_schedule)
            if sweep.done and self.kvwarm_run is not None:
                self.kvwarm_run.finish()
        output = super().schedule(*args, **kwargs)
        if self.kvwarm.has_pending():
            self.kvwarm.admit_pending(self, output)
        return output

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self.kvwarm_sweep is not None:
            self._drive(self.kvwarm_sweep.after_update, scheduler_output)
        return outputs

    def has_requests(self) -> bool:
        # Queued shadows and a running sweep need schedule() calls even when nothing else
        # is waiting (parked chains are not in `running`); without this the engine idles.
        sweeping = self.kvwarm_sweep is not None and self.kvwarm_sweep.has_work()
        return super().has_requests() or self.kvwarm.has_pending() or sweeping


class KvWarmScheduler(KvWarmSchedulerMixin, Scheduler):
    pass


class KvWarmAsyncScheduler(KvWarmSchedulerMixin, AsyncScheduler):
    pass
