"""What the engine benchmarks share; not a benchmark itself (`nox -s bench-S` skips files
whose name starts with `_`). Importing it sets the in-process engine's environment."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvwarm_testing.engine import use_in_process_engine

# The in-process engine (the scheduler is reachable), with room for the benchmarks' chains.
use_in_process_engine(kv_cache_gib=2)


def release_label() -> str:
    """X.Y of the release under test (the session's KVWARM_RELEASE, else vLLM's version),
    for the result's metric name."""
    import vllm

    return ".".join((os.environ.get("KVWARM_RELEASE") or vllm.__version__).split(".")[:2])


def run_in_temp_dir(run: Callable[[Path], None]) -> None:
    """run(folder) in a temporary folder that lives as long as the engine (the model's)."""
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(tmp))


def kvwarm_engine(model: Path, **engine_args):
    """vLLM's LLMEngine over `model` in this process under the sweep's adapter for the CPU
    engine's loop, as the benchmarks run it: seeded, eager, float32, prefix caching on;
    `engine_args` (EngineArgs' fields) add to those or replace them."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    shared = {
        "model": str(model),
        "dtype": "float32",
        "seed": 0,
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "scheduler_cls": "vllm.kvwarm.scheduler.KvWarmScheduler",
    }
    return LLMEngine.from_engine_args(EngineArgs(**{**shared, **engine_args}))


def is_steady_step(scheduler, output) -> bool:
    """Whether a step (the scheduler's output for it, asked before update_from_output) is
    steady decoding: requests scheduled, none new, each decoding one token past its prompt."""
    requests, scheduled = scheduler.requests, output.num_scheduled_tokens
    return (
        bool(scheduled)
        and not output.scheduled_new_reqs
        and set(scheduled.values()) == {1}
        and all(requests[r].num_computed_tokens > requests[r].num_prompt_tokens for r in scheduled)
    )
