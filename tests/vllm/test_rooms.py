"""What the engine side imports: a sweep inside an engine never loads the report's command
code, its HTML and CSV writers, or matplotlib (they live in record.report and record.plot)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

ENGINE_SIDE = [
    "vllm.kvwarm.scheduler",
    "vllm.kvwarm.sweep.run",
    "vllm.kvwarm.sweep.controller",
    "vllm.kvwarm.sweep.command",
    "vllm.kvwarm.ranks",
]
NEVER = ["matplotlib", "vllm.kvwarm.record.report", "vllm.kvwarm.record.plot"]


@functools.cache
def _loaded() -> tuple[set[str], set[str]]:
    """sys.modules in a fresh interpreter after the engine side's imports, then after the
    report's too: one interpreter for both (each imports vLLM, about 10 s)."""
    code = (
        f"import importlib, json, sys\nfor m in {ENGINE_SIDE!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
        "import vllm.kvwarm.record.report\nprint(json.dumps(sorted(sys.modules)))"
    )
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    engine, report = (set(json.loads(line)) for line in lines.splitlines()[-2:])
    return engine, report


def test_the_engine_side_does_not_import_the_report_or_matplotlib():
    engine, _ = _loaded()
    assert set(ENGINE_SIDE) <= engine
    assert [m for m in NEVER if m in engine] == []


def test_the_report_does_load_what_the_engine_side_leaves_out():
    """The check above can fail: the report's own import brings in what it excludes."""
    _, report = _loaded()
    assert {"vllm.kvwarm.record.report", "vllm.kvwarm.record.plot"} <= report
