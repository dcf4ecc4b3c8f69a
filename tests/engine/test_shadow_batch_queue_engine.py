"""Shadows under vLLM's batch queue on the real CPU engine: async scheduling as CUDA has it
(vLLM's default; the CPU platform's override of it lifted, as in test_batch_queue_engine), so
the in-process EngineCore steps by `step_with_batch_queue` through KvWarmAsyncScheduler. The
shared check (kvwarm_testing.fidelity, which the first light runs on the GPU) must prefill and
park its chain there, and forked shadows must decode the greedy tokens natural requests decode.
The same check on the sync loop is test_shadow_engine's.

Runs in the command's pytest process (`-m command`): it starts an engine of its own, which
cannot share a process with the tiny Llama's session engine."""

from __future__ import annotations

import gc

import pytest
from kvwarm_testing.engine import BLOCK_SIZE
from kvwarm_testing.fidelity import shadow_and_natural_tokens

pytestmark = pytest.mark.command


def test_forked_shadows_decode_like_natural_requests_under_the_batch_queue(tmp_path, monkeypatch):
    from kvwarm_testing.engine import keep_async_scheduling
    from kvwarm_testing.tiny_models import make_tiny_llama
    from vllm import LLM

    keep_async_scheduling(monkeypatch)
    llm = LLM(
        model=str(make_tiny_llama(tmp_path / "tiny-llama")),
        dtype="float32",
        seed=0,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=1024,
        max_num_batched_tokens=256,  # the chain's 300 tokens in two chunks, the second in flight
        max_num_seqs=8,
        enable_prefix_caching=True,
        scheduler_cls="vllm.kvwarm.scheduler.KvWarmAsyncScheduler",
    )
    try:
        core = llm.llm_engine.engine_core.engine_core
        assert core.step_fn == core.step_with_batch_queue and core.batch_queue_size == 2
        shadow_tokens, natural = shadow_and_natural_tokens(llm, core, True, "batch-queue")
        assert shadow_tokens == natural
        assert all(len(tokens) == 5 for tokens in natural)
    finally:
        del llm
        gc.collect()
