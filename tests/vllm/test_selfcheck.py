"""`python -m vllm.kvwarm selfcheck` (the in-image check) against this venv's patched build."""

from __future__ import annotations

import vllm
from vllm.kvwarm import build_record
from vllm.kvwarm.selfcheck import problems


def test_the_installed_build_passes_its_own_record():
    record = build_record()
    assert problems("vllm", vllm.__version__, record["series_digest"]) == []


def test_a_wrong_version_series_or_dist_is_named():
    record = build_record()
    wrong = problems("vllm", "0.0.1+kvwarm.9", "f" * 64)
    assert any("the wheel is 0.0.1+kvwarm.9" in p for p in wrong)
    assert any("series digest" in p and record["series_digest"] in p for p in wrong)
    assert problems("no-such-dist", vllm.__version__, record["series_digest"]) == [
        "distribution 'no-such-dist' is not installed"
    ]
