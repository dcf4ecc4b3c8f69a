"""TEST SUPPORT ONLY (never shipped): a vLLM general plugin, loaded in every vLLM process,
that the multi-rank engine tests switch on through the environment.

- KVWARM_TEST_CPU_ALL_GATHERV=1: vLLM's CPU communicator has no `all_gatherv` /
  `reduce_scatterv` (NotImplementedError), which an MoE model under data parallel needs
  on every step. These stand-ins pad to the largest size and use the communicator's
  own `all_gather` / `all_reduce`; they are correct, not fast.
- KVWARM_TEST_PLAN_SKEW=1: every rank salts its sweep's plan digest with its process id,
  so the ranks disagree on their plan (the mismatch path, forced).
- KVWARM_TEST_RANK_BLOCKS=R:N[,R:N...]: data-parallel rank R's KV pool is N blocks (vLLM's own
  `num_gpu_blocks_override`, set for that rank alone as its engine core sizes its pool), as
  on GPUs whose free memory differs: vLLM sizes each rank's pool on its own.
- KVWARM_TEST_RANK_OUT=1: rank R > 0 of a data-parallel sweep writes to `<out>.rank<R>`
  instead of the sweep's `out` (rank_out below), as if each rank's node had a disk of its
  own: the ranks of one launch on this host then share no folder, so only the rank
  exchange can carry anything between them.
"""

from __future__ import annotations

import os
from pathlib import Path


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


RANK_OUT_ENV = "KVWARM_TEST_RANK_OUT"
RANK_BLOCKS_ENV = "KVWARM_TEST_RANK_BLOCKS"


def rank_blocks(text: str) -> dict[int, int]:
    """KVWARM_TEST_RANK_BLOCKS's value: rank -> blocks."""
    return {int(rank): int(blocks) for rank, blocks in (item.split(":") for item in text.split(",") if item)}


def _pool_per_rank(original, blocks: dict[int, int]):
    def _initialize_kv_caches(self, vllm_config):
        parallel = vllm_config.parallel_config
        rank = getattr(parallel, "data_parallel_index", None)
        rank = parallel.data_parallel_rank if rank is None else rank
        if rank in blocks:
            vllm_config.cache_config.num_gpu_blocks_override = blocks[rank]
        return original(self, vllm_config)

    return _initialize_kv_caches


def rank_out(out: str | Path, rank: int) -> Path:
    """Where rank `rank` of a sweep with this `out` writes under KVWARM_TEST_RANK_OUT=1."""
    return Path(out) if rank == 0 else Path(f"{out}.rank{rank}")


def _own_folder_per_rank(original):
    def __init__(self, scheduler, spec, environ=None):
        from vllm.kvwarm.sweep.provenance import rank_layout

        rank = rank_layout(scheduler.vllm_config.parallel_config).data_parallel_rank
        if isinstance(spec, dict) and "out" in spec:
            spec = {**spec, "out": str(rank_out(spec["out"], rank))}
        original(self, scheduler, spec, environ)

    return __init__


def register() -> None:
    if os.environ.get("KVWARM_TEST_CPU_ALL_GATHERV") == "1":
        from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

        CpuCommunicator.all_gatherv = _all_gatherv
        CpuCommunicator.reduce_scatterv = _reduce_scatterv
    if os.environ.get("KVWARM_TEST_PLAN_SKEW") == "1":
        from vllm.kvwarm.sweep.controller import Sweep

        Sweep.plan_digest = _skewed_plan_digest(Sweep.plan_digest)
    if os.environ.get(RANK_BLOCKS_ENV):
        from vllm.v1.engine.core import EngineCore

        blocks = rank_blocks(os.environ[RANK_BLOCKS_ENV])
        EngineCore._initialize_kv_caches = _pool_per_rank(EngineCore._initialize_kv_caches, blocks)
    if os.environ.get(RANK_OUT_ENV) == "1":
        from vllm.kvwarm.sweep.run import SweepRun

        SweepRun.__init__ = _own_folder_per_rank(SweepRun.__init__)
