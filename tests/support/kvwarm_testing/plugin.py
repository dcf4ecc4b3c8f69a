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
- KVWARM_TEST_KILL_AT=MOMENT:N: SIGKILL of this process's group (the sweep command's, started
  in a session of its own: the command and its engine cores) at a named moment of the sweep,
  counted in this process (kill_at below): `build:N` during the N-th rung build (after its
  first prefill step), `step:N` once the N-th timed decode step has run (inside its update),
  `write:N` halfway through writing the N-th row's line of rows.jsonl. With `write`,
  KVWARM_TEST_KILL_FOLDER=NAME kills only the process whose rows.jsonl is in a folder of that
  name (a data-parallel rank's dp<R>), and KVWARM_TEST_KILL_AFTER=PATH:M first waits (60 s at
  most) until PATH holds M row lines (another rank's rows.jsonl): the moment is then the
  same on every run.
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


KILL_ENV, KILL_FOLDER_ENV, KILL_AFTER_ENV = "KVWARM_TEST_KILL_AT", "KVWARM_TEST_KILL_FOLDER", "KVWARM_TEST_KILL_AFTER"


def _kill() -> None:
    import signal

    os.killpg(os.getpgrp(), signal.SIGKILL)


def _rows_in(path: Path) -> int:
    try:
        return path.read_bytes().count(b'"kind":"row"')
    except OSError:
        return 0


def kill_at(moment: str, count: int) -> None:
    """Patch the sweep so this process's group is killed at `moment`'s `count`-th time."""
    import time

    seen = {"builds": 0, "calls": 0, "steps": 0, "rows": 0}
    if moment == "build":
        from vllm.kvwarm.sweep.controller import Sweep

        add, build = Sweep._add_chains, Sweep._build_step

        def _add_chains(self, scheduler, rung):
            seen["builds"], seen["calls"] = seen["builds"] + 1, 0
            return add(self, scheduler, rung)

        def _build_step(self, scheduler):
            seen["calls"] += 1
            # the chains' first prefill step ran in the step that added them: this is the next one's
            if seen["builds"] == count and seen["calls"] == 1:
                _kill()
            return build(self, scheduler)

        Sweep._add_chains, Sweep._build_step = _add_chains, _build_step
    elif moment == "step":
        from vllm.kvwarm.sweep.decode_steps import DecodeSteps

        step = DecodeSteps.step

        def counted(self, output, window=None):
            timed = len(self._times)
            done = step(self, output, window)
            seen["steps"] += len(self._times) - timed
            if seen["steps"] == count and len(self._times) > timed:
                _kill()
            return done

        DecodeSteps.step = counted
    elif moment == "write":
        from vllm.kvwarm.record.row_log import RowLog

        row, folder, after = RowLog.row, os.environ.get(KILL_FOLDER_ENV), os.environ.get(KILL_AFTER_ENV)

        def torn(self, *args, **kwargs):
            if folder and self.path.parent.name != folder:
                return row(self, *args, **kwargs)
            seen["rows"] += 1
            if seen["rows"] != count:
                return row(self, *args, **kwargs)
            self._file.write(b'{"kind":"row","boot":')  # half a line, flushed: what a kill mid-write leaves
            self._file.flush()
            if after:
                path, rows = after.rsplit(":", 1)
                deadline = time.monotonic() + 60
                while _rows_in(Path(path)) < int(rows) and time.monotonic() < deadline:
                    time.sleep(0.05)
            _kill()

        RowLog.row = torn
    else:
        raise ValueError(f"{KILL_ENV}: no moment {moment!r} (build, step, write)")


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
    if os.environ.get(KILL_ENV):
        moment, count = os.environ[KILL_ENV].split(":")
        kill_at(moment, int(count))
    if os.environ.get(RANK_OUT_ENV) == "1":
        from vllm.kvwarm.sweep.run import SweepRun

        SweepRun.__init__ = _own_folder_per_rank(SweepRun.__init__)
