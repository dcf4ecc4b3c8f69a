"""The GPU smoke's first question, answered from `nvidia-smi -L` (a stand-in script here)."""

from __future__ import annotations

import pytest

from kvwarm_build.gpu import gpu_missing_reason


def _stand_in_nvidia_smi(directory, output: str, code: int = 0):
    script = directory / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nprintf '%s\\n' '{output}'\nexit {code}\n")
    script.chmod(0o755)


def test_no_driver_is_a_reason_that_names_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_missing_reason() == "no NVIDIA driver: nvidia-smi is not on PATH"


@pytest.mark.parametrize(
    ("output", "code", "reason"),
    [
        ("GPU 0: NVIDIA H200 (UUID: GPU-1234)", 0, None),
        ("No devices were found", 6, "nvidia-smi -L lists no GPU (exit 6: No devices were found)"),
        ("", 0, "nvidia-smi -L lists no GPU (exit 0)"),
    ],
)
def test_a_listed_gpu_is_required(tmp_path, monkeypatch, output, code, reason):
    _stand_in_nvidia_smi(tmp_path, output, code)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert gpu_missing_reason() == reason
