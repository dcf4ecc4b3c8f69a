"""Killed sweeps resumed on the real CPU engine (a tiny MoE): `python -m vllm.kvwarm sweep` in a
session of its own is SIGKILLed, with every process of its group, at a named moment (the test
plugin's fault hook, KVWARM_TEST_KILL_AT: during a rung build, once a timed step has run, halfway
through writing a row on one of two data-parallel ranks); `--resume` then completes the sweep.
The resumed artifact holds what an uninterrupted sweep of these points holds (every point once,
on real KV, none skipped: tests/engine/test_multi_rank.py's check) and keeps every row the
killed boot finished. And one boot measuring every point on real and fake KV (--ab).

The one-rank cases run under `-m command`, the data-parallel one under `-m multirank`."""

from __future__ import annotations

import json

import pytest
from kvwarm_testing.multi_rank import OWN_FOLDERS, rank_artifact, run_command
from kvwarm_testing.plugin import KILL_AFTER_ENV, KILL_ENV, KILL_FOLDER_ENV

# Two rungs of two decode points (batch 3, then batch 2), contexts up to 150 tokens.
POINTS = [(300, 2), (200, 2), (120, 3), (90, 3)]
ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--block-size", "32"]
ARGS += ["--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--enable-prefix-caching", "--seed", "0"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from kvwarm_testing.engine import fp32_moe_refusal, skip_where_refused
    from kvwarm_testing.tiny_models import make_tiny_qwen3_moe, write_sharegpt

    skip_where_refused(fp32_moe_refusal())
    root = tmp_path_factory.mktemp("resume")
    points = root / "points.json"
    points.write_text(
        json.dumps({"schema_version": 1, "decode": [{"total_kv_read_tokens": k, "batch_size": b} for k, b in POINTS]})
    )
    moe, dataset = make_tiny_qwen3_moe(root / "tiny-moe"), write_sharegpt(root / "sharegpt.json")
    return {"moe": moe, "dataset": dataset, "points": points}


def _env(inputs, **extra) -> dict:
    return {"DYN_BENCH_KV_WARMUP_DATASET": str(inputs["dataset"]), "DYN_BENCH_KV_WARMUP": "force", **extra}


def _sweep(inputs, out, log, env: dict, *extra: str) -> int:
    argv = ["--points", str(inputs["points"]), "--out", str(out), *extra, "--model", str(inputs["moe"]), *ARGS]
    return run_command(argv, env, log, timeout=600)


def _rows(folder) -> list[dict]:
    """The complete row lines of a rows.jsonl."""
    lines = (folder / "rows.jsonl").read_bytes().split(b"\n")[:-1]
    return [line for line in map(json.loads, lines) if line["kind"] == "row"]


def _uninterrupted(artifact: dict) -> None:
    """What an uninterrupted sweep of POINTS holds: every point once, on real KV, none skipped."""
    from vllm.kvwarm.record.schema import validate

    validate(artifact)
    assert artifact["status"] == "complete", artifact["error"]
    keys = [(r["point"]["total_kv_read_tokens"], r["point"]["batch_size"]) for r in artifact["results"]]
    assert sorted(keys) == sorted(POINTS) and artifact["skipped_points"] == []
    assert {r["kv_seed_regime"] for r in artifact["results"]} == {"real_kv"}
    assert all(len(r["steady_seconds"]) == 3 for r in artifact["results"])


@pytest.mark.command
@pytest.mark.parametrize(
    ("moment", "finished"),
    [("build:2", 2), ("step:5", 1)],  # the second rung's build: its first rung's 2 rows; point 2's 2nd timed step
    ids=["during-a-rung-build", "during-a-timed-step"],
)
def test_a_sweep_killed_at_a_moment_resumes_to_every_point_once(inputs, tmp_path, moment, finished):
    out = tmp_path / "out"
    rc = _sweep(inputs, out, tmp_path / "killed.log", _env(inputs, **{KILL_ENV: moment}))
    assert rc == -9, (tmp_path / "killed.log").read_text()[-3000:]
    before = {(r["row"]["total_kv_read_tokens"], r["row"]["batch_size"]): r["row"] for r in _rows(out)}
    assert len(before) == finished
    assert json.loads((out / "sweep.json").read_text())["status"] == "running"  # nobody said why
    rc = _sweep(inputs, out, tmp_path / "resumed.log", _env(inputs), "--resume")
    assert rc == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    artifact = json.loads((out / "sweep.json").read_text())
    _uninterrupted(artifact)
    kept = {k: r for k, r in before.items()}
    for row in artifact["results"]:  # the killed boot's rows, as it measured them
        key = (row["point"]["total_kv_read_tokens"], row["point"]["batch_size"])
        if key in kept:
            assert row["steady_seconds"] == kept[key]["samples"]
    assert [(b["boot"], b["rows"]) for b in artifact["kvwarm"]["boots"]] == [(0, finished), (1, 4 - finished)]
    assert len(_rows(out)) == 4  # no point measured twice
    assert [s["boot"] for s in artifact["kvwarm"]["stages"]].count(1) >= 1  # the chains built again


@pytest.mark.multirank
def test_a_data_parallel_sweep_killed_writing_a_row_resumes_on_both_ranks(inputs, tmp_path):
    """Rank 1 is killed (with the whole command) halfway through writing its second row, once
    rank 0 has written its own: rank 0's second row is then a lone one, measured again on both
    ranks when the sweep resumes, and said in rank 0's artifact."""
    out = tmp_path / "out"
    args = ("--data-parallel-size", "2")
    fault = {KILL_ENV: "write:2", KILL_FOLDER_ENV: "dp1", KILL_AFTER_ENV: f"{out / 'dp0' / 'rows.jsonl'}:2"}
    env = _env(inputs, KVWARM_TEST_CPU_ALL_GATHERV="1", **OWN_FOLDERS)
    rc = _sweep(inputs, out, tmp_path / "killed.log", {**env, **fault}, *args)
    assert rc == -9, (tmp_path / "killed.log").read_text()[-3000:]
    rank_1 = rank_artifact(out, 1, own_folders=True).parent
    assert (len(_rows(out / "dp0")), len(_rows(rank_1))) == (2, 1)
    assert not (rank_1 / "rows.jsonl").read_bytes().endswith(b"\n")  # its second line, torn
    rc = _sweep(inputs, out, tmp_path / "resumed.log", env, "--resume", *args)
    assert rc == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    ranks = [json.loads(rank_artifact(out, r, own_folders=True).read_text()) for r in range(2)]
    for artifact in ranks:
        _uninterrupted(artifact)
        assert [(b["boot"], b["rows"]) for b in artifact["kvwarm"]["boots"]] == [(0, 1), (1, 3)]
    (replaced,) = ranks[0]["kvwarm"]["resume"]["replaced"]
    assert replaced["reason"].startswith("rank(s) [1] had not finished it")
    assert ranks[1]["kvwarm"]["resume"]["replaced"] == []
    combined = json.loads((out / "sweep.json").read_text())
    assert combined["status"] == "complete" and len(combined["results"]) == len(POINTS)
    assert [(r["rank"], r["status"], r["rows"]) for r in combined["ranks"]] == [(0, "complete", 4), (1, "complete", 4)]


@pytest.mark.command
def test_an_ab_sweep_measures_every_point_on_real_and_fake_kv_in_one_boot(inputs, tmp_path):
    from vllm.kvwarm.record.report import ab_comparison, comparison_text
    from vllm.kvwarm.record.runs import load_run

    out = tmp_path / "out"
    rc = _sweep(inputs, out, tmp_path / "ab.log", _env(inputs), "--ab")
    assert rc == 0, (tmp_path / "ab.log").read_text()[-3000:]
    artifact = json.loads((out / "sweep.json").read_text())
    _uninterrupted(artifact)  # its table: the real side
    fake = artifact["ab_fake_side"]
    assert fake["skipped_points"] == [] and {r["kv_seed_regime"] for r in fake["results"]} == {"legacy"}
    assert sorted((r["point"]["total_kv_read_tokens"], r["point"]["batch_size"]) for r in fake["results"]) == sorted(
        POINTS
    )
    # the sides alternate: at each point one goes first, and each side goes first somewhere
    by_point = {}
    for row in [*artifact["results"], *fake["results"]]:
        by_point.setdefault(row["point"]["total_kv_read_tokens"], []).append((row["ab"], row["ab_first"]))
    one_first = ([("fake", False), ("real", True)], [("fake", True), ("real", False)])
    assert all(sorted(sides) in one_first for sides in by_point.values())
    assert {first for sides in by_point.values() for side, first in sides if side == "real"} == {True, False}
    lines = _rows(out)
    assert [line["row"]["ab"] for line in lines].count("fake") == len(POINTS) and len(lines) == 2 * len(POINTS)
    comparison = ab_comparison(load_run(str(out)))
    assert len(comparison.joined) == len(POINTS) and comparison.mape is not None
    print(comparison_text(comparison))  # the A/B of this host, in the test's log
