"""TEST SUPPORT ONLY (never shipped): a vLLM general plugin, loaded in every vLLM process,
that the multi-rank engine tests switch on through the environment.

- KVWARM_TEST_CPU_ALL_GATHERV=1: vLLM's CPU communicator has no `all_gatherv` /
  `reduce_scatterv` (NotImplementedError), which an MoE model under data parallel needs
  on every step. These stand-ins pad to the largest size and use the communicator's
  own `all_gather` / `all_reduce`; they are correct, not fast.
- KVWARM_TEST_PLAN_SKEW=1: every rank salts its sweep's plan digest with its process id,
  so the ranks disagree on their plan (the mismatch path, forced).
"""

from __future__ import annotations

import os


def _all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    import torch

    def gather(tensor):
        if sizes is None:
            return self.all_gather(tensor, dim)
        axis = dim % tensor.dim()
        widest = max(sizes)
        short = widest - tensor.size(axis)
        if short:
            pad_shape = list(tensor.shape)
            pad_shape[axis] = short
            tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], axis)
        parts = self.all_gather(tensor.contiguous(), axis).split(widest, dim=axis)
        return torch.cat([part.narrow(axis, 0, size) for part, size in zip(parts, sizes)], axis)

    return [gather(t) for t in input_] if isinstance(input_, list) else gather(input_)


def _reduce_scatterv(self, input_, dim: int = -1, sizes: list[int] | None = None):
    axis = dim % input_.dim()
    if sizes is None:
        sizes = [input_.size(axis) // self.world_size] * self.world_size
    total = self.all_reduce(input_.clone())
    start = sum(sizes[: self.rank_in_group])
    return total.narrow(axis, start, sizes[self.rank_in_group]).contiguous()


def _skewed_plan_digest(original):
    def plan_digest(self, rung):
        return f"{original(self, rung)}-pid{os.getpid()}"

    return plan_digest


def register() -> None:
    if os.environ.get("KVWARM_TEST_CPU_ALL_GATHERV") == "1":
        from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

        CpuCommunicator.all_gatherv = _all_gatherv
        CpuCommunicator.reduce_scatterv = _reduce_scatterv
    if os.environ.get("KVWARM_TEST_PLAN_SKEW") == "1":
        from vllm.kvwarm.sweep.controller import Sweep

        Sweep.plan_digest = _skewed_plan_digest(Sweep.plan_digest)
