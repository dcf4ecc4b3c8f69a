"""KV warm-up for real-KV decode benchmarking (overlay of the patched vLLM build).

This package is copied into the vLLM tree by the kvwarm build tooling. It never branches on
vLLM's version: what a build can do is probed (see `capabilities`).
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

__all__ = ["build_record"]


@cache
def build_record() -> dict | None:
    """What this vLLM was built from (release, flavour, series digest, revision), or None
    when vllm.kvwarm was put in place by something other than the build tooling."""
    try:
        text = resources.files(__name__).joinpath("_build_record.json").read_text()
    except FileNotFoundError:
        return None
    return json.loads(text)
