"""What the engine side imports: a sweep inside an engine never loads the report's command
code, its HTML and CSV writers, or matplotlib (they live in record.report and record.plot)."""

from __future__ import annotations

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


def test_the_engine_side_does_not_import_the_report_or_matplotlib():
    code = (
        f"import importlib, json, sys\nfor m in {ENGINE_SIDE!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    loaded = json.loads(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()[-1]
    )
    assert set(ENGINE_SIDE) <= set(loaded)
    assert [m for m in NEVER if m in loaded] == []


def test_the_report_does_load_what_the_engine_side_leaves_out():
    """The check above can fail: the report's own import brings in what it excludes."""
    code = "import sys, json, vllm.kvwarm.record.report\nprint(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()[-1]
    )
    assert {"vllm.kvwarm.record.report", "vllm.kvwarm.record.plot"} <= set(loaded)
