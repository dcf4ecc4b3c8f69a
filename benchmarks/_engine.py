"""What the engine benchmarks share; not a benchmark itself (`nox -s bench-S` skips files
whose name starts with `_`). Importing it sets the in-process engine's environment."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# In-process engine core (the scheduler is reachable), one thread, nothing from the hub.
for _key, _value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
                     "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}.items():
    os.environ.setdefault(_key, _value)


def load_tiny_models():
    """tests/engine/tiny_models.py: the random-weight models and the ShareGPT file the tests make."""
    spec = importlib.util.spec_from_file_location("tiny_models", ROOT / "tests" / "engine" / "tiny_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def release_label() -> str:
    """X.Y of the release under test (the session's KVWARM_RELEASE, else vLLM's version),
    for the result's metric name."""
    import vllm

    return ".".join((os.environ.get("KVWARM_RELEASE") or vllm.__version__).split(".")[:2])


def run_in_temp_dir(run: Callable[[Path], None]) -> None:
    """run(folder) in a temporary folder that lives as long as the engine (the model's)."""
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(tmp))
