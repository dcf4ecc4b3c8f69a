"""`python -m vllm.kvwarm selfcheck`: is the installed vLLM the kvwarm build it should be?

Run inside an image right after installing the patched wheel (images/Dockerfile), where
a wrong dist, version or series must stop the build, not surface at serve time.
"""

from __future__ import annotations

import importlib.metadata as md
import re

import vllm
from vllm.kvwarm import build_record

_LABEL = re.compile(r"\+kvwarm\.\d+$")


def problems(dist: str, expect_version: str, expect_series_digest: str) -> list[str]:
    found = []
    try:
        installed = md.version(dist)
    except md.PackageNotFoundError:
        return [f"distribution {dist!r} is not installed"]
    if not _LABEL.search(installed):
        found.append(f"{dist} {installed} has no +kvwarm.N label: the patched wheel is not what got installed")
    if installed != expect_version:
        found.append(f"{dist} is {installed}, the wheel is {expect_version}")
    if vllm.__version__ != installed:
        found.append(f"vllm.__version__ is {vllm.__version__}, the distribution {installed}: two installs overlap")
    record = build_record()
    if record is None:
        return found + ["vllm.kvwarm has no build record"]
    if record.get("version") != expect_version:
        found.append(f"build record version {record.get('version')!r}, expected {expect_version!r}")
    if record.get("series_digest") != expect_series_digest:
        found.append(
            f"build record series digest {record.get('series_digest')!r}, the image label says {expect_series_digest!r}"
        )
    return found


def run(dist: str, expect_version: str, expect_series_digest: str) -> int:
    found = problems(dist, expect_version, expect_series_digest)
    for problem in found:
        print(f"kvwarm selfcheck: {problem}")
    if not found:
        print(f"kvwarm selfcheck: {dist} {expect_version}, series {expect_series_digest[:12]}: ok")
    return 1 if found else 0
