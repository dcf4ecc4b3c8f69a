"""The real vLLM engine on CPU, as every test, benchmark and smoke run here starts it: the
environment (one home for it) and an `LLM` with handles on its scheduler and model runner."""

from __future__ import annotations

import os

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
