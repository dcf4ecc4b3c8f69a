"""What a run records about itself, so that a table and a trace can be reproduced and held
together months later: the build, the engine arguments as given and as vLLM resolved them, the
hardware and torch (`run_record`), the engine loop and the adapter class that serves it
(`loop_record`), and the data-parallel layout (`rank_layout`). The sweep's artifact and the
served-step trace's header both write it from here; record.validate.match compares two of
them. Read once per run; nothing here touches a GPU (no CUDA context is made in the
engine-core process: GPUs are listed through NVML).

The engine loop: vLLM settles `scheduler_config.async_scheduling` when it makes the engine's
config (VllmConfig.__post_init__: unset means on unless an option rules it out, then the
platform has the last word; the CPU platform turns it off). The engine core then steps through
EngineCore.step (schedule, forward, update_from_output, one step at a time) or, with async
scheduling on, through EngineCore.step_with_batch_queue over `max_concurrent_batches` steps
(two): step n+1 is scheduled and submitted before step n's output is taken in. The async
adapter serves that loop (vLLM's AsyncScheduler schedules a request again while its last step
is in flight); the sync adapter serves the other. Under the batch queue a decode point's
requests run one untimed step after the timed ones (trailing_steps; sweep.decode_steps says
why).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ..kv.layout import ATTENTION, group_layouts
from ..record import vocabulary as v
from ..record.shape import SPLIT_SIZES
from .graphs import split_sizes

# --- the layout ---------------------------------------------------------------------------

# The data-parallel size this engine process was launched with: vLLM resets a dense
# model's ranks to DP=1 before the engine core (and the scheduler) is built, so the
# series' hook in the engine-core launcher records it here first (docs/hooks.md).
_launch_data_parallel_size: int | None = None


def note_launch(data_parallel_size: int) -> None:
    global _launch_data_parallel_size
    _launch_data_parallel_size = int(data_parallel_size)


@dataclass(frozen=True)
class RankLayout:
    """The engine's parallel layout as the sweep records it."""

    data_parallel_size: int
    data_parallel_rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    expert_parallel: bool

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def rank_layout(parallel_config) -> RankLayout:
    rank = getattr(parallel_config, "data_parallel_index", None)
    if rank is None:
        rank = parallel_config.data_parallel_rank
    size = max(parallel_config.data_parallel_size, _launch_data_parallel_size or 1)
    return RankLayout(
        size,
        int(rank),
        parallel_config.tensor_parallel_size,
        parallel_config.pipeline_parallel_size,
        bool(parallel_config.enable_expert_parallel),
    )


# --- the engine loop ------------------------------------------------------------------------

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


# --- the engine arguments, the hardware, torch -----------------------------------------------


def resolved_engine_args(scheduler) -> dict:
    vllm_config = scheduler.vllm_config
    model, cache = vllm_config.model_config, vllm_config.cache_config
    groups = scheduler.kv_cache_config.kv_cache_groups
    compilation = getattr(vllm_config, "compilation_config", None)
    cudagraph_mode = getattr(compilation, "cudagraph_mode", None)
    split = split_sizes(compilation) or (None, None)  # None: one list for both kinds
    return {
        "block_sizes": {
            f"{i}:{type(g.kv_cache_spec).__name__}": g.kv_cache_spec.block_size for i, g in enumerate(groups)
        },
        "max_num_seqs": vllm_config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
        "max_model_len": model.max_model_len,
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(cache.cache_dtype),
        "enable_prefix_caching": bool(cache.enable_prefix_caching),
        "mamba_cache_mode": getattr(cache, "mamba_cache_mode", None),
        "enforce_eager": bool(model.enforce_eager),
        "cudagraph_mode": None if cudagraph_mode is None else str(cudagraph_mode),
        "cudagraph_capture_sizes": sorted(getattr(compilation, "cudagraph_capture_sizes", None) or []),
        # where vLLM resolves them apart (None elsewhere): prefill graphs by tokens, decode by requests
        **{name: None if sizes is None else list(sizes) for name, sizes in zip(SPLIT_SIZES, split)},
        # the KV pool, in blocks and in the tokens its attention groups hold (the exports'
        # max_kv_tokens)
        "num_gpu_blocks": scheduler.kv_cache_config.num_blocks,
        "kv_cache_tokens": kv_cache_tokens(scheduler),
        "model_type": getattr(model.hf_config, "model_type", None),
        "architectures": list(getattr(model.hf_config, "architectures", None) or []),
        "async_scheduling": bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)),
        "enable_chunked_prefill": bool(getattr(vllm_config.scheduler_config, "enable_chunked_prefill", False)),
        "long_prefill_token_threshold": getattr(vllm_config.scheduler_config, "long_prefill_token_threshold", None),
        "parallel": parallel_record(vllm_config.parallel_config),
        # where the model runs: in the engine core's process ("uni") or in worker processes
        # ("mp", which vLLM's CPU platform forces under a server): a step of each differs
        "distributed_executor_backend": executor_backend(vllm_config.parallel_config),
    }


def executor_backend(parallel_config) -> str | None:
    """The executor backend as vLLM resolved it: its name, or a custom executor class's name."""
    backend = getattr(parallel_config, "distributed_executor_backend", None)
    return backend.__name__ if isinstance(backend, type) else None if backend is None else str(backend)


# The parallel settings, as vLLM resolved them, that Dynamo's engine block carries besides the
# layout (a release without one of them: null).
PARALLEL_SETTINGS = (
    "prefill_context_parallel_size",
    "decode_context_parallel_size",
    "enable_eplb",
    "all2all_backend",
    "eplb_config",
    "data_parallel_backend",
)


def parallel_record(parallel_config) -> dict:
    return {name: _plain(getattr(parallel_config, name, None)) for name in PARALLEL_SETTINGS}


def _plain(value):
    """A resolved setting as JSON: a config dataclass as its fields, an enum as its value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(x) for x in value]
    if isinstance(value, dict):
        return {str(k): _plain(x) for k, x in value.items()}
    return str(value)


def kv_cache_tokens(scheduler) -> int | None:
    """How many tokens' KV the pool holds: its blocks times the attention groups' block size
    (None without an attention group)."""
    sizes = [g.block_size for g in group_layouts(scheduler.kv_cache_manager) if g.kind == ATTENTION]
    return scheduler.kv_cache_config.num_blocks * max(sizes) if sizes else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# How the kernel backs memory with huge pages, a host setting that can move a step's time; on
# the development host three tables under `always` lay closer together than three under
# `madvise`, in a spell when the host itself drifted (measurements/served-vs-table.md): recorded, not settled
HUGE_PAGES = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_pages() -> str | None:
    """The transparent huge page mode the kernel has selected (`[always] madvise never`:
    always); None where the host does not say."""
    try:
        selected = re.search(r"\[(\w+)\]", HUGE_PAGES.read_text())
    except OSError:
        return None
    return selected.group(1) if selected else None


def _gpus() -> tuple[list[dict], str | None]:
    try:
        from vllm.third_party import pynvml
    except ImportError:
        try:
            import pynvml
        except ImportError:
            return [], None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001  (no driver: a CPU host; NVML's own error class varies)
        return [], None
    try:
        names = [
            pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())
        ]
        driver = pynvml.nvmlSystemGetDriverVersion()
    finally:
        pynvml.nvmlShutdown()
    names = [n.decode() if isinstance(n, bytes) else n for n in names]
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return [{"name": n, "count": c} for n, c in counts.items()], driver.decode() if isinstance(
        driver, bytes
    ) else driver


def hardware() -> dict:
    import torch

    gpus, driver = _gpus()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "gpus": gpus,
        "driver": driver,
        "cuda_runtime": torch.version.cuda,
        "python": platform.python_version(),
        "transparent_hugepages": _huge_pages(),
    }


def run_record(scheduler, given: list[str] | None = None) -> dict:
    """The artifact's fields that describe the run (the build record comes from the wheel).
    `given`: the engine arguments as the user gave them, where known (the sweep command
    passes its own); else this process's command line (a server's, under `vllm serve`)."""
    import torch
    from vllm.kvwarm import build_record

    return {
        "build": build_record(),
        "torch": torch.__version__,
        "hardware": hardware(),
        "engine_args": {
            "given": list(sys.argv if given is None else given),
            "resolved": resolved_engine_args(scheduler),
        },
    }
