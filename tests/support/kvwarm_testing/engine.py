"""The real vLLM engine on CPU, as every test, benchmark and smoke run here starts it: the
environment (one home for it) and an `LLM` with handles on its scheduler and model runner."""

from __future__ import annotations

import os
from types import SimpleNamespace

# What every CPU engine here needs: one thread, a small KV cache, nothing from the hub.
CPU_ENGINE_ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# Several ranks on two cores: one thread each, not pinned; loopback for DP's message queues.
MULTI_RANK_ENV = {**CPU_ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_HOST_IP": "127.0.0.1"}
# The engine core in the caller's process: the scheduler and the runner are reachable.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

BLOCK_SIZE = 32  # the tests' CPU block size
# In the exports' folder (consumers-S): the real sweeps were not made here, and why.
EXPORTS_SKIPPED = "SKIPPED"


def use_in_process_engine(kv_cache_gib: int = 1) -> None:
    """Set (where not set already) what an in-process CPU engine of this process needs."""
    for key, value in {**CPU_ENGINE_ENV, **IN_PROCESS, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}.items():
        os.environ.setdefault(key, value)


def fp32_conv_refusal() -> str | None:
    """Why this host's CPU engine cannot load an fp32 Mamba2 model (None when it can). On a
    CPU with AVX-512 BF16, vLLM prepacks causal_conv1d weights with a kernel that some
    releases implement for bf16 only; probed by packing a small fp32 weight."""
    import torch

    if not torch.cpu._is_avx512_bf16_supported():
        return None
    from vllm import _custom_ops as ops

    if not hasattr(ops, "causal_conv1d_weight_pack"):
        return None
    try:
        ops.causal_conv1d_weight_pack(torch.zeros(64, 4))  # (channels, width): channels a multiple of 32
    except NotImplementedError as err:  # the dtype; any other error is the probe's own and is raised
        return f"this CPU has AVX-512 BF16, and vLLM's causal_conv1d weight prepack refuses fp32 here ({err})"
    return None


def skip_where_refused(refusal: str | None) -> None:
    """pytest.skip, naming why, where one of the probes here refused (they return None where
    the engine runs the model)."""
    if refusal:
        import pytest

        pytest.skip(refusal)


def fp32_moe_refusal() -> str | None:
    """Why this host's CPU engine refuses an fp32 MoE (None when it takes one). On a CPU with
    AMX tiles some releases' CPU fused MoE takes bf16 layers only and refuses the rest at
    load (naming an alignment it did not check); probed by asking its own check about a
    small fp32 layer of aligned sizes."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return None
    try:
        from vllm.model_executor.layers.fused_moe.cpu_fused_moe import CPUFusedMOE
    except ImportError:
        return None
    check = getattr(CPUFusedMOE, "check_grouped_gemm", None)
    if check is None:
        return None
    layer = SimpleNamespace(w13_weight=torch.zeros(2, 64, 32), w2_weight=torch.zeros(2, 32, 32), activation=None)
    try:
        check(object.__new__(CPUFusedMOE), layer)
    except RuntimeError as err:  # the refusal; any other error is the probe's own and is raised
        return f"this CPU has AMX tiles, and vLLM's CPU fused MoE refuses an fp32 layer here ({str(err)[:100]}...)"
    return None


_GDN_PROBE = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="bfloat16", mamba_ssm_cache_dtype="float32", mamba_cache_mode="align", seed=0,
          enforce_eager=True, max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=4)
llm.generate([{"prompt_token_ids": list(range(3, 303))}], SamplingParams(max_tokens=1))
"""


def hybrid_kernel_refusal(model) -> str | None:
    """Why this host's CPU engine cannot run the tiny Qwen3-Next (`model`, a folder) in bf16
    (None when it can). On a CPU with AMX tiles some releases' gated-delta-rule prefill kernel
    dies of an illegal instruction once a oneDNN AMX matmul has run before it in the process
    (the engine's first prefill passes, the next one dies, killing the process); probed by
    an engine of its own in a child process, a prefill after its warm-up. About 30 s, and
    only on such a CPU."""
    import signal
    import subprocess
    import sys

    import torch

    if not torch.cpu._is_amx_tile_supported():
        return None
    env = {**os.environ, **CPU_ENGINE_ENV, **IN_PROCESS}
    probe = [sys.executable, "-c", _GDN_PROBE, str(model)]
    done = subprocess.run(probe, check=False, env=env, capture_output=True, text=True)
    if done.returncode == -signal.SIGILL:
        return (
            "this CPU has AMX tiles, and vLLM's CPU gated-delta-rule kernel dies of an illegal instruction after "
            "an AMX matmul in the same process (probed: a prefill after the engine's warm-up)"
        )
    if done.returncode:
        raise RuntimeError(f"the hybrid kernel probe failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return None


def keep_async_scheduling(monkeypatch) -> None:
    """Async scheduling as vLLM resolves it, as on CUDA: the CPU platform turns it off after
    vLLM has resolved it (CpuPlatform.check_and_update_config); here the platform keeps
    vLLM's value. For this process, until `monkeypatch` undoes it."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    platform_update = platform.check_and_update_config

    def keep_resolved(cls, vllm_config):
        resolved = vllm_config.scheduler_config.async_scheduling
        platform_update(vllm_config)
        vllm_config.scheduler_config.async_scheduling = resolved

    monkeypatch.setattr(platform, "check_and_update_config", classmethod(keep_resolved))


# What the CPU platform turns off that CUDA keeps (CpuPlatform.check_and_update_config):
# async scheduling (so vLLM's batch queue), and for MLA models prefix caching (and chunked
# prefill, left off: the reference MLA backend's prefill takes no cached context).
CPU_OVERRIDES = ("scheduler_config.async_scheduling", "cache_config.enable_prefix_caching")


def lift_cpu_overrides(fields: tuple[str, ...] = CPU_OVERRIDES, patch=setattr) -> None:
    """The CPU platform's overrides of `fields` lifted: each keeps the value vLLM resolved
    before the platform's update, as on CUDA. With `patch` setattr for the rest of the process
    (an engine process of a benchmark or a first-light step); with a pytest monkeypatch's
    setattr until it undoes it. Nothing changes on another platform."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    platform = type(current_platform)
    platform_update = platform.check_and_update_config

    def keep_resolved(cls, vllm_config):
        parts = [(vllm_config, field.split(".")) for field in fields]
        resolved = [(getattr(config, section), name) for config, (section, name) in parts]
        values = [getattr(section, name) for section, name in resolved]
        platform_update(vllm_config)
        for (section, name), value in zip(resolved, values):
            setattr(section, name, value)

    patch(platform, "check_and_update_config", classmethod(keep_resolved))


def cpu_mla_refusal() -> str | None:
    """Why this release's CPU engine cannot run an MLA model (None when it has an MLA backend:
    the reference one, CPU_MLA, which takes a latent of 512 + 64 per token only)."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        return "this release has no attention backend registry to find a CPU MLA backend in"
    if "CPU_MLA" not in AttentionBackendEnum.__members__:
        return "this release's CPU platform has no MLA backend (its attention selector refuses MLA on CPU)"
    return None


def engine_env(device: str) -> dict[str, str]:
    """The environment of an engine in another process on `device` (cpu | cuda)."""
    return dict(CPU_ENGINE_ENV) if device == "cpu" else {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


class Engine:
    """An `LLM` plus handles on its scheduler and model runner."""

    def __init__(self, llm):
        self.llm = llm
        self.core = llm.llm_engine.engine_core.engine_core  # EngineCore: step() skips the frontend
        core = self.core
        self.scheduler = core.scheduler
        self.runner = core.model_executor.driver_worker.worker.model_runner

    @property
    def kv_cache_manager(self):
        return self.scheduler.kv_cache_manager

    def attention_manager(self):
        return self.kv_cache_manager.coordinator.single_type_managers[0]

    def layer_kv(self, layer: int = 0):
        """The worker's KV cache tensor of one attention layer (blocks first)."""
        return self.runner.kv_caches[layer]

    def add(self, request_id: str, prompt: list[int], max_tokens: int, salt: str) -> str:
        """Add a greedy request; returns the id the scheduler knows it by."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
        before = set(self.scheduler.requests)
        self.llm.llm_engine.add_request(
            request_id,
            TokensPrompt(prompt_token_ids=prompt, cache_salt=salt),
            params,
        )
        (internal,) = set(self.scheduler.requests) - before
        return internal

    def step(self) -> dict:
        """One engine step; the finished requests' outputs by the id they were added with."""
        return {out.request_id: out for out in self.llm.llm_engine.step() if out.finished}

    def run_to_completion(self) -> dict:
        finished = {}
        while self.llm.llm_engine.has_unfinished_requests():
            finished.update(self.step())
        return finished
