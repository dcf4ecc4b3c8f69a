"""Sweeps on several ranks of the real CPU engine (vLLM's own processes: the API server and
the sweep command with --data-parallel-size / --tensor-parallel-size): every rank completes
with the same plan, per-rank and combined artifacts agree, outside requests never enter a
timed step, a failure stops every rank without a hang, and the server serves on. The ranks
meet through the store (the default exchange); in the data-parallel sweeps each rank writes
to a folder of its own, so nothing but the store carries anything between them; a rank
killed mid-sweep is named by the survivor.

Runs in its own pytest process (`-m multirank`); this process starts no engine itself. The
MoE cases (the hybrid is one), the forced plan mismatch and the per-rank folders need the
test-only plugin (kvwarm_testing.plugin).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from kvwarm_testing.multi_rank import (
    ADAPTER,
    OWN_FOLDERS,
    api_server,
    engine_args,
    engine_core_pid,
    medians_by_point,
    rank_artifact,
    read_json,
    run_command,
    wait_final,
    write_points,
)
from kvwarm_testing.plugin import rank_out
from vllm.kvwarm.record.row_log import read_log

pytestmark = pytest.mark.multirank

# 42 points over three rungs, contexts up to 300 tokens (batch per rank)
POINTS = [(k, b) for b in (1, 2, 3) for k in range(60 * b, 60 * b + 14 * 40 * b, 40 * b)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from kvwarm_testing.tiny_models import make_tiny_llama, make_tiny_qwen3_moe, make_tiny_qwen3_next, write_sharegpt

    root = tmp_path_factory.mktemp("multirank")
    return {
        "llama": make_tiny_llama(root / "tiny-llama"),
        "moe": make_tiny_qwen3_moe(root / "tiny-moe"),
        "hybrid": make_tiny_qwen3_next(root / "tiny-qwen3-next"),
        "dataset": write_sharegpt(root / "sharegpt.json"),
        "root": root,
    }


def _env(inputs, **extra) -> dict:
    return {"DYN_BENCH_KV_WARMUP_DATASET": str(inputs["dataset"]), "DYN_BENCH_KV_WARMUP": "force", **extra}


def _check_ranks(out, size: int, points, own_folders: bool = False) -> tuple[dict, list[dict]]:
    """Every rank complete on real KV with the same stages, and the combined view agreeing.
    own_folders: each rank wrote to its own OUT, which holds its dp<R>/ alone (rank 0's also
    the combined view), and no exchange left a file behind."""
    from vllm.kvwarm.record.schema import validate

    combined = json.loads((out / "sweep.json").read_text())
    ranks = [json.loads(rank_artifact(out, r, own_folders).read_text()) for r in range(size)]
    if own_folders:
        assert sorted(p.name for p in out.iterdir()) == ["dp0", "sweep.csv", "sweep.json"]
        for rank in range(1, size):
            assert sorted(p.name for p in rank_out(out, rank).iterdir()) == [f"dp{rank}"]
    for rank, artifact in enumerate(ranks):
        validate(artifact)
        assert artifact["status"] == "complete", artifact["error"]
        assert artifact["layout"]["data_parallel_rank"] == rank and artifact["layout"]["data_parallel_size"] == size
        assert artifact["skipped_points"] == [] and len(artifact["results"]) == len(points)
        assert {r["kv_seed_regime"] for r in artifact["results"]} == {"real_kv"}
        assert artifact["kvwarm"]["reset_prefix_cache"] is True
    stages = [[(s["batch"], s["depth"]) for s in a["kvwarm"]["stages"]] for a in ranks]
    assert all(s == stages[0] for s in stages), stages
    validate(combined)
    assert combined["status"] == "complete" and combined["artifact_type"] == "kvwarm.combined"
    assert [(r["rank"], r["status"], r["rows"]) for r in combined["ranks"]] == [
        (r, "complete", len(points)) for r in range(size)
    ]
    per_rank = [medians_by_point(a) for a in ranks]
    for row in combined["results"]:
        key = (row["point"]["total_kv_read_tokens"], row["point"]["batch_size"])
        assert row["median_seconds"] == max(m[key] for m in per_rank)
        assert row["global_batch_size"] == key[1] * size
    return combined, ranks


def _dp2_server_args(inputs, tmp_path, out) -> list[str]:
    """`vllm serve` of the tiny llama on two data-parallel ranks, sweeping POINTS into out."""
    spec = {"points": str(write_points(tmp_path / "points.json", POINTS)), "out": str(out)}
    return engine_args(
        inputs["llama"],
        "--data-parallel-size",
        "2",
        "--scheduler-cls",
        ADAPTER,
        "--additional-config",
        json.dumps({"kvwarm_sweep": spec}),
    )


def test_a_data_parallel_server_sweeps_on_every_rank_and_serves_on(inputs, tmp_path):
    out = tmp_path / "out"
    args = _dp2_server_args(inputs, tmp_path, out)
    answers = []
    with api_server(args, _env(inputs, **OWN_FOLDERS), tmp_path / "server.log") as server:

        def users():  # outside requests while the sweep runs
            for n in range(6):
                answers.append(server.complete(f"decode prefill cache {n}", max_tokens=8))

        thread = threading.Thread(target=users)
        thread.start()
        combined = wait_final(out / "sweep.json")
        thread.join(timeout=300)
        assert combined["status"] == "complete", combined["error"]
        after = server.complete("the sweep is over", max_tokens=4)
    _check_ranks(out, 2, POINTS, own_folders=True)  # every point measured with exactly B: none skipped
    assert len(answers) == 6 and all(a["choices"][0]["text"] for a in answers)
    assert after["usage"]["completion_tokens"] == 4


def test_a_plan_mismatch_fails_every_rank_and_the_command_without_a_hang(inputs, tmp_path):
    out = tmp_path / "out"
    rc = run_command(
        [
            "--points",
            str(write_points(tmp_path / "points.json", POINTS[:3])),
            "--out",
            str(out),
            *engine_args(inputs["llama"], "--data-parallel-size", "2"),
        ],
        _env(inputs, KVWARM_TEST_PLAN_SKEW="1"),
        tmp_path / "cmd.log",
        timeout=600,
    )
    assert rc == 1
    combined = json.loads((out / "sweep.json").read_text())
    assert combined["status"] == "failed"
    for rank in combined["ranks"]:
        assert rank["status"] == "failed" and "plan mismatch before rung batch=1" in rank["error"]
        assert rank["rows"] == 0


def test_the_command_sweeps_an_moe_model_in_lockstep_on_two_data_parallel_ranks(inputs, tmp_path):
    """`python -m vllm.kvwarm sweep --data-parallel-size 2` exits 0 once both ranks completed."""
    out = tmp_path / "out"
    points = POINTS[::3]
    rc = run_command(
        [
            "--points",
            str(write_points(tmp_path / "points.json", points)),
            "--out",
            str(out),
            *engine_args(inputs["moe"], "--data-parallel-size", "2"),
        ],
        _env(inputs, KVWARM_TEST_CPU_ALL_GATHERV="1", **OWN_FOLDERS),
        tmp_path / "cmd.log",
    )
    assert rc == 0, (tmp_path / "cmd.log").read_text()[-3000:]
    _check_ranks(out, 2, points, own_folders=True)


def test_a_grid_sweep_with_prefill_points_on_two_ranks_with_unequal_pools_lays_one_grid(inputs, tmp_path):
    """`--grid` on two data-parallel ranks whose KV pools differ (the test plugin sizes each
    rank's pool with vLLM's own num_gpu_blocks_override; on GPUs free memory does that), each
    rank writing to a folder of its own: both complete the same grid, prefill and decode
    points, laid in the smaller pool; rank 0 alone writes grid.json; the view is complete."""
    out = tmp_path / "out"
    caps = {"decode_batches": 2, "kv_ladder": 2, "prefill_tokens": 2, "mixed": 1}
    rc = run_command(
        ["--grid", json.dumps(caps), "--out", str(out), *engine_args(inputs["llama"], "--data-parallel-size", "2")],
        _env(inputs, KVWARM_TEST_RANK_BLOCKS="0:300,1:240", **OWN_FOLDERS),
        tmp_path / "cmd.log",
    )
    assert rc == 0, (tmp_path / "cmd.log").read_text()[-3000:]
    ranks = [json.loads(rank_artifact(out, r, own_folders=True).read_text()) for r in range(2)]
    pools = [a["config"]["engine_args"]["resolved"]["num_gpu_blocks"] for a in ranks]
    assert pools == [300, 240]  # the pools really differ
    grids = [dict(a["kvwarm"]["grid"]) for a in ranks]
    for grid in grids:
        grid.pop("points_file")
    assert grids[0] == grids[1] and grids[0]["pool"]["num_blocks"] == min(pools)
    points = [sorted(json.dumps(r["point"], sort_keys=True) for r in a["results"]) for a in ranks]
    assert points[0] == points[1] and len(points[0]) == grids[0]["points"]
    assert {r["point"]["point_type"] for r in ranks[0]["results"]} == {"prefill", "decode", "mixed"}
    assert {r["kv_seed_regime"] for r in ranks[0]["results"]} <= {"real_kv", "real_prefix", "not_applicable"}
    assert all(a["status"] == "complete" and a["skipped_points"] == [] for a in ranks)
    grid_file = json.loads((out / "grid.json").read_text())
    assert sum(len(grid_file[kind]) for kind in ("prefill", "decode", "mixed")) == grids[0]["points"]
    assert not (rank_out(out, 1) / "grid.json").exists()
    combined = json.loads((out / "sweep.json").read_text())
    assert combined["status"] == "complete"
    assert [(r["rank"], r["rows"]) for r in combined["ranks"]] == [(0, len(points[0])), (1, len(points[0]))]
    assert len(combined["results"]) == len(points[0])


def test_mixed_points_run_in_lockstep_on_two_data_parallel_ranks_each_step_their_exact_shape(inputs, tmp_path):
    """A points file of mixed points and a decode point on two data-parallel ranks of the MoE:
    every rank measures every mixed point as one step of its decode part's shadows beside its
    prefill part's requests on a real prefix (the step's shape is checked per shot on each
    rank: a step of another shape would be a skip), and the combined view holds them."""
    out = tmp_path / "out"
    prefill = {"total_prefill_tokens": 96, "total_kv_read_tokens": 128, "batch_size": 1}
    mixed = [
        {"decode": {"total_kv_read_tokens": 300, "batch_size": 2}, "prefill": prefill},
        {"decode": {"total_kv_read_tokens": 120, "batch_size": 1}, "prefill": {**prefill, "total_kv_read_tokens": 0}},
    ]
    points = tmp_path / "points.json"
    points.write_text(
        json.dumps({"schema_version": 2, "decode": [{"total_kv_read_tokens": 200, "batch_size": 2}], "mixed": mixed})
    )
    rc = run_command(
        ["--points", str(points), "--out", str(out), *engine_args(inputs["moe"], "--data-parallel-size", "2")],
        _env(inputs, KVWARM_TEST_CPU_ALL_GATHERV="1", **OWN_FOLDERS),
        tmp_path / "cmd.log",
    )
    assert rc == 0, (tmp_path / "cmd.log").read_text()[-3000:]
    ranks = [json.loads(rank_artifact(out, r, own_folders=True).read_text()) for r in range(2)]
    for rank, artifact in enumerate(ranks):
        assert artifact["status"] == "complete" and artifact["skipped_points"] == [], artifact.get("error")
        assert artifact["layout"]["data_parallel_rank"] == rank
        rows = [r for r in artifact["results"] if r["point"]["point_type"] == "mixed"]
        assert sorted(
            (r["point"]["decode"]["batch_size"], r["point"]["prefill"]["total_kv_read_tokens"]) for r in rows
        ) == [(1, 0), (2, 128)]
        for row in rows:
            assert row["sample_kind"] == "shot_forward" and len(row["steady_seconds"]) == 3
            assert all(t > 0 for t in row["steady_seconds"])
        assert [r["point"]["point_type"] for r in artifact["results"]].count("decode") == 1
    combined = json.loads((out / "sweep.json").read_text())
    assert combined["status"] == "complete"
    assert [(r["rank"], r["status"], r["rows"]) for r in combined["ranks"]] == [(0, "complete", 3), (1, "complete", 3)]


# The hybrid (an MoE, so its ranks step in lockstep) in align mode, bf16 with fp32 state.
HYBRID = ["--dtype", "bfloat16", "--mamba-ssm-cache-dtype", "float32", "--mamba-cache-mode", "align"]


def test_mixed_points_on_a_hybrid_in_exact_state_hold_their_shape_on_two_data_parallel_ranks(inputs, tmp_path):
    """The tiny Qwen3-Next on two data-parallel ranks in exact state (the build's default): a
    first launch sweeps the decode point alone, its artifact giving the engine's state block
    (vLLM sizes it in the workers); the second sweeps it with two mixed points whose prefill
    part stays within a state block (align mode stops a prefill at the last boundary before
    its prompt's end), on a prefix of one state block and on none. Every rank measures every
    mixed step in its exact shape (a step of another shape would be a skip), with the state
    stamps its decode row gets, and the combined view holds both ranks' rows."""
    import math

    decode = {"total_kv_read_tokens": 900, "batch_size": 2}
    env = _env(inputs, KVWARM_TEST_CPU_ALL_GATHERV="1", **OWN_FOLDERS)
    args = engine_args(inputs["hybrid"], *HYBRID, "--data-parallel-size", "2")
    exact = ["kvwarm_real_kv", "kvwarm_state_exact"]

    def sweep(name: str, points: dict) -> list[dict]:
        out, file = tmp_path / name, tmp_path / f"{name}.json"
        file.write_text(json.dumps({"schema_version": 2, **points}))
        rc = run_command(["--points", str(file), "--out", str(out), *args], env, tmp_path / f"{name}.log")
        assert rc == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        ranks = [json.loads(rank_artifact(out, r, own_folders=True).read_text()) for r in range(2)]
        for rank, artifact in enumerate(ranks):
            assert artifact["status"] == "complete" and artifact["skipped_points"] == [], artifact.get("error")
            assert artifact["layout"]["data_parallel_rank"] == rank
            assert len(artifact["results"]) == len(points.get("decode", [])) + len(points.get("mixed", []))
        combined = json.loads((out / "sweep.json").read_text())
        assert combined["status"] == "complete"
        assert [(r["rank"], r["status"], r["rows"]) for r in combined["ranks"]] == [
            (r, "complete", len(ranks[0]["results"])) for r in range(2)
        ]
        return ranks

    def reasons(row) -> list[str]:  # less the noise stamp a busy host may give any row
        return [r for r in row["sample_reasons"] if r != "kvwarm_noisy"]

    first = sweep("decode", {"decode": [decode]})
    sizes = first[0]["config"]["engine_args"]["resolved"]["block_sizes"]
    assert any("Mamba" in group for group in sizes), sizes  # state groups, in align mode
    unit = math.lcm(*sizes.values())
    assert unit > 24  # the prefill parts' new tokens per request stay within a state block
    mixed = [
        {"decode": decode, "prefill": {"total_prefill_tokens": 24, "total_kv_read_tokens": unit, "batch_size": 1}},
        {
            "decode": {"total_kv_read_tokens": 301, "batch_size": 2},
            "prefill": {"total_prefill_tokens": 30, "total_kv_read_tokens": 0, "batch_size": 2},
        },
    ]
    for artifact in sweep("mixed", {"decode": [decode], "mixed": mixed}):
        assert artifact["config"]["engine_args"]["resolved"]["block_sizes"] == sizes
        (decode_row,) = [r for r in artifact["results"] if r["point"]["point_type"] == "decode"]
        assert (decode_row["kv_seed_regime"], reasons(decode_row)) == ("real_kv", [*exact, "kvwarm_state_depth=450"])
        rows = sorted(
            (r for r in artifact["results"] if r["point"]["point_type"] == "mixed"),
            key=lambda r: -r["point"]["prefill"]["total_kv_read_tokens"],
        )
        assert [(r["point"]["decode"], r["point"]["prefill"]) for r in rows] == [
            (m["decode"], m["prefill"]) for m in mixed
        ]
        assert [(r["kv_seed_regime"], reasons(r)) for r in rows] == [
            ("real_kv", ["prefill_real_seed", *exact, "kvwarm_state_depth=450"]),
            ("real_kv", [*exact, "kvwarm_state_depth=151"]),
        ]
        for row in rows:
            assert row["sample_kind"] == "shot_forward" and len(row["steady_seconds"]) == 3
            assert all(t > 0 for t in row["steady_seconds"])


# Below vLLM's grace between the SIGTERM and the SIGKILL it sends the surviving engine cores
# when one dies (5 s), so the survivor records why it stops before it is killed.
KILL_TIMEOUT = 3
# Rank 1 is stopped (SIGSTOP) this long before its kill -9: the survivor then waits at its
# next boundary when vLLM's SIGTERM comes, never inside a point (see the test).
FREEZE_SECONDS = 1.0


def test_a_rank_killed_mid_sweep_is_named_by_the_survivor_which_keeps_every_row(inputs, tmp_path):
    """kill -9 of rank 1's engine core under a DP=2 server. vLLM's own answer is to shut the
    whole server down: the API process sends the surviving engine core SIGTERM, which aborts
    every request and steps on while the scheduler has work, and SIGKILL 5 s later. Rank 0,
    waiting for rank 1 at its next boundary, gives up on it after its rank timeout (here
    shorter than that grace) and writes `failed`, naming rank 1, with every row it measured;
    so does the combined view.

    Rank 1 is frozen for FREEZE_SECONDS before the kill: had vLLM's abort come while rank 0
    was inside a point, it would take that point's requests away and the sweep would wait
    for steps that never come until the SIGKILL (its artifact left `running`, every earlier
    row in it): a race of the abort against the point, not of the exchange."""
    out = tmp_path / "out"
    log = tmp_path / "server.log"
    args = _dp2_server_args(inputs, tmp_path, out)
    # the ranks' start (engine cores seconds apart on a busy host) is waited for as long as usual
    timeouts = {"DYN_BENCH_KV_WARMUP_RANK_TIMEOUT": str(KILL_TIMEOUT), "DYN_BENCH_KV_WARMUP_RANK_START_TIMEOUT": "300"}
    env = _env(inputs, **timeouts, **OWN_FOLDERS)
    with api_server(args, env, log) as server:
        deadline = time.monotonic() + 600
        # rank 1's rows as they end (its rows.jsonl: its sweep.json is rewritten at a pace,
        # and a sweep of tiny points would be nearly done before it showed 8)
        rows_1 = rank_artifact(out, 1, own_folders=True).parent / "rows.jsonl"
        while True:
            rank_1 = read_json(rank_artifact(out, 1, own_folders=True)) or {"status": "running", "results": []}
            assert rank_1["status"] == "running", {  # a rank that ended early: say how
                key: rank_1.get(key) for key in ("status", "error", "skipped_points")
            } | {"rows": len(rank_1["results"])}
            if rows_1.exists() and len(read_log(rows_1).rows) >= 8:
                break
            assert time.monotonic() < deadline, "rank 1 measured no 8 points"
            time.sleep(0.05)
        victim = engine_core_pid(server.pid, 1)
        os.kill(victim, signal.SIGSTOP)
        time.sleep(FREEZE_SECONDS)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        own = wait_final(rank_artifact(out, 0, own_folders=True), timeout=120)
        stopped = time.monotonic() - killed
        combined = wait_final(out / "sweep.json", timeout=60)
    assert own["status"] == "failed", own["error"]
    assert own["error"].startswith("RankFailed: rank(s) [1] did not reach boundary")
    assert own["error"].endswith(f"within {KILL_TIMEOUT} s")
    assert stopped < KILL_TIMEOUT + 5  # a poll of the artifact a second
    # every point rank 0 finished (a line of its rows.jsonl, written as each ends) is in its artifact
    finished = read_log(rank_artifact(out, 0, own_folders=True).parent / "rows.jsonl").rows
    assert len(own["results"]) + len(own["skipped_points"]) == len(finished) >= 8
    assert combined["status"] == "failed"
    assert [(r["rank"], r["status"]) for r in combined["ranks"]] == [(0, "failed"), (1, "failed")]
    assert combined["ranks"][1]["error"].startswith("rank 0 gave up on it: rank(s) [1] did not reach boundary")
    assert combined["ranks"][0]["rows"] == len(own["results"]) and combined["ranks"][1]["rows"] >= 8


def test_a_tensor_parallel_sweep_measures_every_point_on_real_kv(inputs, tmp_path):
    from vllm.kvwarm.record.schema import validate

    out = tmp_path / "out"
    points = POINTS[::4]
    rc = run_command(
        [
            "--points",
            str(write_points(tmp_path / "points.json", points)),
            "--out",
            str(out),
            *engine_args(inputs["moe"], "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"),
        ],
        _env(inputs),
        tmp_path / "cmd.log",
    )
    assert rc == 0, (tmp_path / "cmd.log").read_text()[-3000:]
    artifact = json.loads((out / "sweep.json").read_text())
    validate(artifact)
    assert artifact["layout"]["tensor_parallel_size"] == 2 and artifact["layout"]["data_parallel_size"] == 1
    assert artifact["status"] == "complete" and len(artifact["results"]) == len(points)
    assert {r["kv_seed_regime"] for r in artifact["results"]} == {"real_kv"}
    # the two workers' collectors were held too (each point held, then collected between)
    gc_record = artifact["kvwarm"]["gc"]
    workers = gc_record["workers"]
    assert workers["policy"] == "held" and workers["processes"] == 2, workers
    assert len(set(workers["pids"])) == 2 and os.getpid() not in workers["pids"]
    assert workers["collections_between_points"] == [len(points)] * 2
    assert set(workers["heap_at_end"]) <= {"unfrozen", "refrozen"}
    assert (gc_record["engine_froze_heap"], gc_record["heap_at_end"]) == (True, "refrozen")
