"""What step_fidelity measures: the settings of each mode (full, quick, the variance study
with its variants and the engine process's allocators), the models (CASES) and the ladder of
points an engine runs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

MAX_MODEL_LEN, BLOCK, BATCHED_TOKENS = 2048, 32, 2048
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32]  # with --gpu-defaults on CUDA: the ladders' batches, few to capture


@dataclass(frozen=True)
class Settings:
    pairs: int  # counted shadow/natural pairs per point
    steps: int  # steady steps per measurement
    batches: tuple[int, ...]
    contexts: tuple[int, ...]  # per-request contexts of the attention-only ladders
    hybrid_points: tuple[tuple[int, int], ...]  # (K, B) of the hybrid ladders
    runs: dict[str, int]  # engine processes per case
    # What the variance study turns off or on (the defaults are the controlled benchmark):
    natural_blocks: str = "own"  # own: a natural measurement hits its earlier blocks; fresh: new ones
    gc_hold: bool = True  # the collector held out of both sides' measurements
    pin: bool = True  # the engine process pinned to one CPU
    isolate: bool = False  # with pin: the engine's other threads (gloo's loops, ...) on the other CPUs
    modes: tuple[str, ...] | None = None  # the hybrids' state modes (default: every one)
    flush_denormal: bool = False  # torch.set_flush_denormal: subnormal floats read as zero
    allocator: str = "glibc"  # the engine process's malloc: a key of ALLOCATORS
    # The engine as vLLM sets it up on a GPU (--gpu-defaults): async scheduling at vLLM's
    # default (its batch queue, the async adapter; the CPU platform's override of it lifted)
    # and, on CUDA, graphs. Off: one step at a time (EngineCore.step), eager.
    gpu_defaults: bool = False
    # On CUDA beside other engines: a share of the GPU and a fixed KV pool (else vLLM's defaults)
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Settings:
        data = json.loads(text)
        data["hybrid_points"] = tuple(tuple(p) for p in data["hybrid_points"])
        for key in ("batches", "contexts", "modes"):
            data[key] = tuple(data[key]) if data[key] is not None else None
        return cls(**data)


FULL = Settings(
    pairs=12,
    steps=8,
    batches=(1, 4, 16),
    contexts=(256, 1024, 2000),
    hybrid_points=((2800, 2), (1400, 2), (2800, 4), (1400, 4)),
    runs={"dense": 1, "moe": 1, "hybrid-variant": 6, "hybrid-tiny": 3},
)
QUICK = Settings(
    pairs=4,
    steps=4,
    batches=(1, 4),
    contexts=(512,),
    hybrid_points=((1400, 2),),  # with --only (the quick mode runs the dense model alone)
    runs={"dense": 1},
)
# The variance study (--variance): the dense model at two points, each source of
# measurement-to-measurement variance let loose in turn.
VARIANCE = replace(FULL, batches=(1, 16), contexts=(1024,), runs={"dense": 1})
VARIANTS = {
    "controlled": {},
    "fresh blocks": {"natural_blocks": "fresh"},
    "collector free": {"gc_hold": False},
    "unpinned": {"pin": False},
    "isolated": {"isolate": True},
    "glibc, no trim": {"allocator": "glibc-no-trim"},
    "tcmalloc": {"allocator": "tcmalloc"},
    "huge pages": {"allocator": "thp"},
}
# The engine process's malloc, set in its environment before it starts. glibc's default
# gives memory above its trim threshold back to the kernel and serves large blocks by mmap:
# the next step that needs them faults their pages in again (and the kernel zeroes them).
# vLLM's own CPU launcher preloads tcmalloc where it finds it; an in-process engine, as here
# and in every test, runs on whatever the interpreter started with.
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's libtcmalloc-minimal4
ALLOCATORS = {
    "glibc": {},
    "glibc-no-trim": {"MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)},
    "tcmalloc": {"LD_PRELOAD": str(TCMALLOC)},
    # torch's CPU allocator asks for transparent huge pages (madvise) for large blocks: the KV
    # cache; with the kernel's THP in `madvise` mode, nothing else gets them.
    "thp": {"THP_MEM_ALLOC_ENABLE": "1"},
}


@dataclass(frozen=True)
class Case:
    title: str
    maker: str  # a kvwarm_testing.tiny_models maker
    engine: dict
    modes: tuple[str | None, ...] = (None,)  # state hand-off modes (hybrids)

    def hybrid(self) -> bool:
        return self.modes != (None,)


_COMMON = {"seed": 0, "enforce_eager": True, "max_model_len": MAX_MODEL_LEN, "enable_prefix_caching": True}
_HYBRID = {
    **_COMMON,
    "dtype": "bfloat16",
    "mamba_ssm_cache_dtype": "float32",
    "mamba_cache_mode": "align",
    "enable_expert_parallel": True,
    "max_num_batched_tokens": BATCHED_TOKENS,
    "max_num_seqs": 16,
}
CASES = {
    "dense": Case(
        "small Llama (dense: hidden 512, 2 layers, fp32)",
        "make_small_llama",
        {**_COMMON, "dtype": "float32", "block_size": BLOCK, "max_num_batched_tokens": BATCHED_TOKENS},
    ),
    "moe": Case(
        "small Qwen3-MoE (hidden 512, 2 layers, 8 experts top-2, fp32, expert parallel)",
        "make_small_qwen3_moe",
        {
            **_COMMON,
            "dtype": "float32",
            "block_size": BLOCK,
            "max_num_batched_tokens": BATCHED_TOKENS,
            "enable_expert_parallel": True,
        },
    ),
    "hybrid-variant": Case(
        "Qwen3-Next variant (attention 0 and 3, linear 1 and 2, hidden 64, 8 experts top-2, bf16, EP)",
        "make_qwen3_next_variant",
        _HYBRID,
        ("copy", "inplace", "exact"),
    ),
    "hybrid-tiny": Case(
        "tiny Qwen3-Next (3 linear + 1 attention layer, 4 experts top-2, bf16, EP)",
        "make_tiny_qwen3_next",
        _HYBRID,
        ("copy", "inplace", "exact"),
    ),
}


def ladder(case: Case, settings: Settings):
    from vllm.kvwarm.sweep.points import DecodePoint

    if case.hybrid():
        return [DecodePoint(k, b) for k, b in settings.hybrid_points]
    # deepest first within a batch, the largest batch first: the order the sweep measures in
    return [
        DecodePoint(b * c, b)
        for b in sorted(settings.batches, reverse=True)
        for c in sorted(settings.contexts, reverse=True)
    ]
