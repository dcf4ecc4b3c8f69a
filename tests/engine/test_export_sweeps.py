"""Real CPU sweeps exported for Dynamo: tiny MoE models with the warm-up on, on one rank (expert
parallel, real KV, 8 KV heads) and on two data-parallel ranks (make_tiny_qwen3_moe, the test
plugin's collectives shim, no expert parallel, the warm-up forced). Each sweep runs with
DYN_FPM_BENCHMARK_OUTPUT_PATH set, so it writes Dynamo's artifact itself; the export
(`python -m vllm.kvwarm export` for the first) then writes the same files from the sweep's
folder, and the profiler's tables.

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
from kvwarm_testing.multi_rank import ADAPTER, api_server, engine_args, run_command, write_points
from kvwarm_testing.served import load_args, random_dataset, run_load, settled, trace_lines

pytestmark = pytest.mark.export

HOOK_ENV = "DYN_FPM_BENCHMARK_OUTPUT_PATH"
# One rank: contexts per request from 64 to 3968 tokens, B up to 8, five timed steps per point,
# on the tiny MoE with 8 KV heads (wide_kv_moe), so that reading K up to 31744 tokens costs a
# step tens of ms: the slope the planner's model fits stands above a busy host's noise.
POINTS_DP1 = [(c * b, b) for b in (1, 2, 4, 8) for c in (64, 1024, 2560, 3968)]
ENGINE_DP1 = ["--enable-expert-parallel", "--max-model-len", "4096", "--max-num-batched-tokens", "1024"]
POINTS_DP2 = [(c * b, b) for b in (1, 2, 4) for c in (64, 512)]


def wide_kv_moe(directory: Path) -> Path:
    """make_tiny_qwen3_moe's model with 8 KV heads instead of 1: 8 KiB of KV per token, so a
    decode step's cost grows with K well above the noise of a shared two-core host."""
    from kvwarm_testing.tiny_models import make_tiny_qwen3_moe

    return make_tiny_qwen3_moe(directory, kv_heads=8)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from kvwarm_testing.engine import EXPORTS_SKIPPED, fp32_moe_refusal, skip_where_refused
    from kvwarm_testing.tiny_models import make_tiny_qwen3_moe, write_sharegpt

    refusal = fp32_moe_refusal()
    if refusal and os.environ.get("KVWARM_EXPORTS"):  # the consumers' tests then say why they have nothing to read
        (Path(os.environ["KVWARM_EXPORTS"]) / EXPORTS_SKIPPED).write_text(refusal)
    skip_where_refused(refusal)
    root = tmp_path_factory.mktemp("export")
    dataset = write_sharegpt(root / "sharegpt.json", conversations=256)  # chains of ~4000 tokens
    return {
        "moe": make_tiny_qwen3_moe(root / "tiny-moe"),
        "wide": wide_kv_moe(root / "wide-kv-moe"),
        "dataset": dataset,
    }


def _sweep(inputs, work: Path, points, extra_args: list[str], env: dict, command: bool = False, model="moe") -> dict:
    """The sweep command to its end, then both exports (`command`: Dynamo's through
    `python -m vllm.kvwarm export`, which imports vLLM in a process of its own, about 20 s
    on the development host; else in this process, as the same `run`)."""
    from vllm.kvwarm.record.export.command import run

    out, hook = work / "sweep", work / "hook" / "benchmark.json"
    hook.parent.mkdir(parents=True)
    hook.write_text("an earlier run's file, which the sweep removes at its start")
    env = {"DYN_BENCH_KV_WARMUP_DATASET": str(inputs["dataset"]), HOOK_ENV: str(hook), **env}
    argv = ["--points", str(write_points(work / "points.json", points)), "--out", str(out)]
    rc = run_command([*argv, *engine_args(inputs[model], *extra_args)], env, work / "sweep.log")
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
    env = {"DYN_BENCH_KV_WARMUP": "on", "DYN_BENCH_GIANT_KV_REPEATS": "5"}
    made = _sweep(inputs, work, POINTS_DP1, ENGINE_DP1, env, command=True, model="wide")
    _check(work, made, 1, "real_kv")


def test_a_two_rank_data_parallel_moe_sweep_exports_one_file_per_rank(inputs, tmp_path):
    work = tmp_path / "dp2"
    env = {"DYN_BENCH_KV_WARMUP": "force", "KVWARM_TEST_CPU_ALL_GATHERV": "1"}
    made = _sweep(inputs, work, POINTS_DP2, ["--data-parallel-size", "2"], env)
    _check(work, made, 2, "real_kv")


def test_a_served_trace_exports_as_dynamos_fpm_capture(inputs, tmp_path):
    """The MoE served under vLLM's own load generator with the trace on, then `export --to fpm`;
    kept for the consumers' tests (their planner models learn from it)."""
    from vllm.kvwarm.record.export.command import run

    work = tmp_path / "served"
    trace = work / "trace"
    args = engine_args(
        inputs["moe"],
        "--scheduler-cls",
        ADAPTER,
        "--additional-config",
        json.dumps({"kvwarm_trace": {"out": str(trace)}}),
    )
    work.mkdir()
    with api_server(args, {}, work / "server.log") as server:
        load = load_args(server.url, str(inputs["moe"]), random_dataset(512, 16, 0.5), 16, rate=16)
        assert run_load(load, work / "load.log")["completed"] == 16
        settled(lambda: len(trace_lines(trace)[1]))
    assert run([str(trace), "--to", "fpm"]) == 0
    _, steps = trace_lines(trace)
    captured = (trace / "fpm.jsonl").read_text().splitlines()
    assert len(captured) == len(steps) > 0
    keep = os.environ.get("KVWARM_EXPORTS")
    if keep:  # for the consumers' tests, in their own venv
        shutil.copytree(work, Path(keep) / work.name, ignore=shutil.ignore_patterns("*.log"))
