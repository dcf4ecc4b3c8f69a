"""The real vLLM engine on CPU (cpu flavour of the patched wheel), in this process.

One engine per test session: two CPU engines at once fail vLLM's start-up memory check,
and a start costs tens of seconds.
"""

from __future__ import annotations

import os

# In-process engine core (the scheduler and the runner are reachable from the test),
# one thread, 1 GiB of KV cache, nothing fetched from the hub.
for _key, _value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402
from tiny_models import make_tiny_llama  # noqa: E402

# Tests that need an engine of their own kind: one kind per pytest process.
OWN_ENGINE_MARKERS = ("hybrid", "mamba2", "command", "multirank", "tp2")


def pytest_configure(config):
    config.addinivalue_line("markers", "hybrid: needs the hybrid-model engine (its own process)")
    config.addinivalue_line("markers", "mamba2: needs the Mamba2 hybrid engine, NemotronH (its own process)")
    config.addinivalue_line("markers", "command: starts its own engine through the sweep command (its own process)")
    config.addinivalue_line("markers", "multirank: starts data/tensor-parallel engines in subprocesses (its own process)")
    config.addinivalue_line("markers", "tp2: a tensor-parallel engine of two workers (its own process)")


@pytest.hookimpl(trylast=True)  # after `-m` has deselected
def pytest_collection_modifyitems(config, items):
    kinds = {next((m for m in OWN_ENGINE_MARKERS if item.get_closest_marker(m)), "llama") for item in items}
    if len(kinds) > 1:
        raise pytest.UsageError(
            f"tests/engine: {sorted(kinds)} engine tests need one process each (two CPU engines at once "
            "fail vLLM's memory check); select one kind with -m, as `nox -s engine-X` does")


BLOCK_SIZE = 32


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
            request_id, TokensPrompt(prompt_token_ids=prompt, cache_salt=salt), params,
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


@pytest.fixture(scope="session")
def engine(tmp_path_factory) -> Engine:
    from vllm import LLM

    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    llm = LLM(
        model=str(model), dtype="float32", seed=0, enforce_eager=True,
        block_size=BLOCK_SIZE, max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=8,
        enable_prefix_caching=True, scheduler_cls="vllm.kvwarm.scheduler.KvWarmScheduler",
    )
    return Engine(llm)
