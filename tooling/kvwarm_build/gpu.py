"""Whether this host can run the GPU smoke: an NVIDIA driver that lists a GPU.

Asked before anything is installed, so a host without a GPU skips in a second with the
reason, instead of downloading CUDA builds it cannot use.
"""

from __future__ import annotations

import shutil
import subprocess


def gpu_missing_reason() -> str | None:
    """None when `nvidia-smi -L` lists a GPU; otherwise why the GPU smoke cannot run."""
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return "no NVIDIA driver: nvidia-smi is not on PATH"
    try:
        listing = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        return "nvidia-smi -L did not answer within 60 s"
    gpus = [line for line in listing.stdout.splitlines() if line.startswith("GPU ")]
    if listing.returncode != 0 or not gpus:
        detail = (listing.stderr or listing.stdout).strip().splitlines()[:1]
        return f"nvidia-smi -L lists no GPU (exit {listing.returncode}{': ' + detail[0] if detail else ''})"
    return None
