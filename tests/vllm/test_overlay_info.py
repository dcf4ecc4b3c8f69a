"""The overlay inside the installed build: build record and capability report."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import vllm
from vllm.kvwarm import build_record
from vllm.kvwarm.__main__ import main
from vllm.kvwarm.kv.capabilities import CAPABILITIES, probe

SCHEDULER_SIDE = {c.name for c in CAPABILITIES if c.module.startswith("vllm.v1.core")}


def test_build_record_matches_the_installed_distribution():
    record = build_record()
    assert record is not None, "vllm.kvwarm has no build record: not installed from a kvwarm build"
    assert vllm.__version__ == record["version"]
    assert importlib.metadata.version("vllm") == record["version"]
    assert record["version"].startswith(record["release"] + "+kvwarm.")
    assert record["flavour"] == "cuda"
    assert len(record["series_digest"]) == 64


def test_probe_reports_every_scheduler_side_capability_as_seen():
    report = probe()
    assert set(report) == {c.name for c in CAPABILITIES}
    for name in SCHEDULER_SIDE:
        assert report[name]["present"] in (True, False), report[name]
    # The CoW pieces come as a set: a build has all of them or none.
    cow = {
        report[n]["present"]
        for n in (
            "manager_apply_cow",
            "manager_take_pending_cow_copies",
            "take_kv_cache_block_copies",
            "scheduler_output_block_copies",
            "kv_cache_block_copy",
        )
    }
    assert len(cow) == 1


def test_probe_sees_a_real_attribute_and_misses_a_fake_one():
    from vllm.kvwarm.kv.capabilities import _has
    from vllm.v1.core import block_pool

    assert _has(block_pool, "BlockPool.touch")
    assert not _has(block_pool, "BlockPool.no_such_hook")


def test_info_command_prints_record_and_capabilities(capsys):
    # One run as `python -m` (the module's entry point), the text form in this process: each
    # fresh interpreter imports vLLM again (about 15 s).
    out = subprocess.run(
        [sys.executable, "-m", "vllm.kvwarm", "info", "--json"], capture_output=True, text=True, check=True
    ).stdout
    report = json.loads(out[out.index("{") :])
    assert report["build"] == build_record()
    assert report["vllm_version"] == vllm.__version__
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert build_record()["series_digest"] in text
    for cap in CAPABILITIES:
        assert cap.name in text
