"""The real vLLM engine on CPU (cpu flavour of the patched wheel), in this process.

One engine per test session: two CPU engines at once fail vLLM's start-up memory check,
and a start costs tens of seconds.
"""

from __future__ import annotations

import pytest
from kvwarm_testing.engine import BLOCK_SIZE, Engine, use_in_process_engine
from kvwarm_testing.tiny_models import make_tiny_llama

from kvwarm_build.sessions import ENGINE_MARKERS

use_in_process_engine()


def pytest_configure(config):
    for marker, what in ENGINE_MARKERS.items():
        config.addinivalue_line("markers", f"{marker}: {what}")


@pytest.hookimpl(trylast=True)  # after `-m` has deselected
def pytest_collection_modifyitems(config, items):
    kinds = {next((m for m in ENGINE_MARKERS if item.get_closest_marker(m)), "llama") for item in items}
    if len(kinds) > 1:
        raise pytest.UsageError(
            f"tests/engine: {sorted(kinds)} engine tests need one process each (two CPU engines at once "
            "fail vLLM's memory check); select one kind with -m, as `nox -s engine-X` does"
        )


@pytest.fixture(scope="session")
def engine(tmp_path_factory) -> Engine:
    from vllm import LLM

    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    llm = LLM(
        model=str(model),
        dtype="float32",
        seed=0,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=1024,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        enable_prefix_caching=True,
        scheduler_cls="vllm.kvwarm.scheduler.KvWarmScheduler",
    )
    return Engine(llm)
