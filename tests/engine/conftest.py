"""The real vLLM engine on CPU (cpu flavour of the patched wheel), in this process.

One engine per test session: two CPU engines at once fail vLLM's start-up memory check,
and a start costs tens of seconds.
"""

from __future__ import annotations

import pytest
from kvwarm_testing.engine import BLOCK_SIZE, Engine, use_in_process_engine
from kvwarm_testing.tiny_models import make_tiny_llama

use_in_process_engine()

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
