"""Shadows under tensor parallel on the real CPU engine (two workers in vLLM's own processes,
the engine core in this one): forked shadows decode exactly like natural requests, so the
copies reach every worker. Runs in its own pytest process (`-m tp2`)."""

from __future__ import annotations

import os

import pytest
from kvwarm_testing.fidelity import shadow_and_natural_tokens
from kvwarm_testing.multi_rank import ENV

pytestmark = pytest.mark.tp2


def test_forked_shadows_decode_like_natural_requests_on_two_tensor_parallel_workers(tmp_path):
    from kvwarm_testing.tiny_models import make_tiny_llama
    from vllm import LLM

    for key in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_HOST_IP"):
        os.environ[key] = ENV[key]
    llm = LLM(
        model=str(make_tiny_llama(tmp_path / "tiny-llama")),
        dtype="float32",
        seed=0,
        enforce_eager=True,
        block_size=32,
        max_model_len=1024,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        enable_prefix_caching=True,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        scheduler_cls="vllm.kvwarm.scheduler.KvWarmScheduler",
    )
    core = llm.llm_engine.engine_core.engine_core
    shadow_tokens, natural = shadow_and_natural_tokens(llm, core, True, "tp2")
    assert shadow_tokens == natural
