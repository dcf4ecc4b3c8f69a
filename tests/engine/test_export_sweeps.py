"""Real CPU sweeps exported for Dynamo: a tiny MoE with the warm-up on, on one rank (expert
parallel, real KV) and on two data-parallel ranks (the test plugin's collectives shim, no
expert parallel, the warm-up forced). Each sweep runs with DYN_FPM_BENCHMARK_OUTPUT_PATH set,
so it writes Dynamo's artifact itself; `python -m vllm.kvwarm export` then writes the same
files from the sweep's folder, and the profiler's tables.

Runs in its own pytest process (`-m export`); this process starts no engine itself. With
KVWARM_EXPORTS set (nox -s consumers-S sets it) the sweeps and their exports are kept there
for tests/engine/test_export_consumers.py, which reads them with Dynamo's own code in a venv
of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kvwarm_testing.multi_rank import engine_args, run_command, write_points

pytestmark = pytest.mark.export

HOOK_ENV = "DYN_FPM_BENCHMARK_OUTPUT_PATH"
# contexts per request from 32 to 896 tokens (max_model_len 1024), B up to 8 per rank
POINTS_DP1 = [(c * b, b) for b in (1, 2, 4, 8) for c in (32, 256, 640, 896)]
POINTS_DP2 = [(c * b, b) for b in (1, 2, 4) for c in (64, 512)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from kvwarm_testing.tiny_models import make_tiny_qwen3_moe, write_sharegpt

    root = tmp_path_factory.mktemp("export")
    return {"moe": make_tiny_qwen3_moe(root / "tiny-moe"), "dataset": write_sharegpt(root / "sharegpt.json")}


def _sweep(inputs, work: Path, points, extra_args: list[str], env: dict, command: bool = False) -> dict:
    """The sweep command to its end, then both exports (`command`: Dynamo's through
    `python -m vllm.kvwarm export`, which imports vLLM in a process of its own, about 20 s
    on the development host; else in this process, as the same `run`)."""
    from vllm.kvwarm.record.export import run

    out, hook = work / "sweep", work / "hook" / "benchmark.json"
    hook.parent.mkdir(parents=True)
    hook.write_text("an earlier run's file, which the sweep removes at its start")
    env = {"DYN_BENCH_KV_WARMUP_DATASET": str(inputs["dataset"]), HOOK_ENV: str(hook), **env}
    argv = ["--points", str(write_points(work / "points.json", points)), "--out", str(out)]
    rc = run_command([*argv, *engine_args(inputs["moe"], *extra_args)], env, work / "sweep.log")
    assert rc == 0, (work / "sweep.log").read_text()[-3000:]
    for to, dest in (("dynamo", work / "dynamo" / "benchmark.json"), ("profiler", work / "profiler")):
        args = [str(out), "--to", to, "--out", str(dest)]
        if command and to == "dynamo":
            done = subprocess.run(
                [sys.executable, "-m", "vllm.kvwarm", "export", *args], capture_output=True, text=True, check=False
            )
            assert done.returncode == 0, done.stderr
        else:
            assert run(args) == 0
    return {"out": out, "hook": hook.parent, "dynamo": work / "dynamo", "profiler": work / "profiler"}


def _rank_files(folder: Path, size: int) -> list[dict]:
    names = ["benchmark.json", *(f"benchmark_dp{r}.json" for r in range(1, size))]
    assert sorted(p.name for p in folder.glob("benchmark*.json")) == sorted(names)
    return [json.loads((folder / name).read_text()) for name in names]


def _check(work: Path, made: dict, size: int, regime: str) -> None:
    """The sweep's own files and the command's agree; every rank's file is complete and valid."""
    ours = _rank_files(made["dynamo"], size)
    theirs = _rank_files(made["hook"], size)
    for mine, hooked in zip(ours, theirs):
        assert mine["config"].pop("output_path") != hooked["config"].pop("output_path")
        assert mine == hooked  # the same export, whichever wrote it
    for rank, artifact in enumerate(ours):
        assert (artifact["status"], artifact["valid"], artifact["usable"], artifact["timing_valid"]) == (
            "complete",
            True,
            True,
            True,
        )
        assert artifact["dp"] == {"rank": rank, "size": size} and artifact["config"]["mode"] == "decode"
        assert {r["kv_seed_regime"] for r in artifact["results"]} == {regime}
    names = {p.relative_to(made["profiler"]).as_posix() for p in made["profiler"].rglob("*") if p.is_file()}
    assert names == {"selected_decode_interpolation/raw_data.npz", "decode_raw_data.json"}
    keep = os.environ.get("KVWARM_EXPORTS")
    if keep:  # for the consumers' tests, in their own venv
        shutil.copytree(work, Path(keep) / work.name, ignore=shutil.ignore_patterns("*.log", ".kvwarm-*"))


def test_a_one_rank_moe_sweep_on_real_kv_exports_for_dynamo(inputs, tmp_path):
    work = tmp_path / "dp1"
    made = _sweep(inputs, work, POINTS_DP1, ["--enable-expert-parallel"], {"DYN_BENCH_KV_WARMUP": "on"}, command=True)
    _check(work, made, 1, "real_kv")


def test_a_two_rank_data_parallel_moe_sweep_exports_one_file_per_rank(inputs, tmp_path):
    work = tmp_path / "dp2"
    env = {"DYN_BENCH_KV_WARMUP": "force", "KVWARM_TEST_CPU_ALL_GATHERV": "1"}
    made = _sweep(inputs, work, POINTS_DP2, ["--data-parallel-size", "2"], env)
    _check(work, made, 2, "real_kv")
