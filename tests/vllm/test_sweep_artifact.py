"""The sweep's artifact (JSON against its schema, CSV, PNG) and the sweep command's
handling of bad input: a clear message and an artifact that records why."""

from __future__ import annotations

import copy
import csv
import json

import pytest
from vllm.kvwarm.record.artifact import KvwarmMeta, PointRow, build_artifact, write_artifact
from vllm.kvwarm.record.plot import write_plot
from vllm.kvwarm.record.schema import validate
from vllm.kvwarm.sweep.progress import ArtifactRows


def _rows():
    return [
        PointRow(1000, 4, "real_kv", ["kvwarm_real_kv"], [0.010, 0.012, 0.011], 0.011),
        PointRow(
            4000,
            4,
            "real_kv",
            ["kvwarm_real_kv", "kvwarm_state_copy", "kvwarm_state_depth=1001"],
            [0.020, 0.021, 0.022],
            0.021,
        ),
        PointRow(9000, 4, "skip:decode_injection_failed", detail="pool_exhausted: 3 more free block(s) needed"),
    ]


META = KvwarmMeta(
    enabled=True,
    warm_eligible=True,
    giant_kv_repeats=3,
    giant_kv_threshold=1_000_000,
    state_mode_requested="auto",
    state_mode="copy",
    reset_prefix_cache=True,
    stages=[{"batch": 4, "depth": 2254, "build_seconds": 1.5}],
    dataset={
        "path": "/d/sharegpt.json",
        "sha256": "ab" * 32,
        "collection_pool": "conversation_sha256_even",
        "conversations": 10,
    },
)


def test_artifact_files_are_written_and_valid(tmp_path):
    import importlib.util

    artifact = build_artifact(_rows(), META, {"model": "m"}, "complete")
    paths = write_artifact(tmp_path, artifact) + [write_plot(tmp_path, artifact)]
    plots = importlib.util.find_spec("matplotlib") is not None
    assert [p.name for p in paths if p] == ["sweep.json", "sweep.csv"] + (["sweep.png"] if plots else [])
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert data["schema_version"] == 3 and data["artifact_type"] == "kvwarm.rank"
    assert data["kvwarm"]["points_real_kv"] == 2 and data["kvwarm"]["points_fake_fallback"] == 0
    first = data["results"][0]
    assert (first["min_seconds"], first["median_seconds"], first["max_seconds"]) == (0.010, 0.011, 0.012)
    assert first["spread"] == pytest.approx(0.002 / 0.011) and first["global_batch_size"] == 4
    assert data["skipped_points"] == [
        {
            "point": {"point_type": "decode", "total_kv_read_tokens": 9000, "batch_size": 4, "total_prefill_tokens": 0},
            "kv_seed_regime": "skip:decode_injection_failed",
            "reason": "pool_exhausted: 3 more free block(s) needed",
        }
    ]
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [(r["total_kv_read_tokens"], r["median_ms"], r["min_ms"], r["max_ms"]) for r in rows] == [
        ("1000", "11.0000", "10.0000", "12.0000"),
        ("4000", "21.0000", "20.0000", "22.0000"),
    ]
    if plots:
        png = (tmp_path / "sweep.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_concurrent_writers_never_collide_on_a_temporary_file(tmp_path):
    """Two ranks (threads here) rewriting files in one folder: every write lands whole."""
    import threading

    from vllm.kvwarm.record.files import write_atomically

    errors = []

    def writer(n):
        try:
            for i in range(200):
                write_atomically(tmp_path / "shared.json", json.dumps({"writer": n, "i": i}).encode())
        except Exception as err:  # noqa: BLE001  (a shared temp name made one writer's replace fail)
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and json.loads((tmp_path / "shared.json").read_text())["i"] == 199
    assert [p.name for p in tmp_path.iterdir()] == ["shared.json"]  # no temporary file left behind


@pytest.mark.parametrize(
    "break_it",
    [
        lambda a: a.update(status="fine"),
        lambda a: a["results"][0].update(steady_seconds=[]),
        lambda a: a["kvwarm"].update(state_mode="sideways"),
        lambda a: a["skipped_points"][0].update(kv_seed_regime="real_kv"),
        lambda a: a["results"][0].update(kv_seed_regime="fake"),
        lambda a: a["kvwarm"]["dataset"].update(sha256="not-a-digest"),
        lambda a: a["kvwarm"]["stages"][0].pop("depth"),
    ],
)
def test_the_schema_rejects_malformed_artifacts(break_it):
    import jsonschema

    artifact = build_artifact(_rows(), copy.deepcopy(META), {}, "complete")
    validate(artifact)
    break_it(artifact)
    with pytest.raises(jsonschema.ValidationError):
        validate(artifact)


def _sweep(tmp_path, monkeypatch, points, env):
    from vllm.kvwarm.sweep.command import run

    for name in ("DYN_BENCH_KV_WARMUP", "DYN_BENCH_KV_WARMUP_DATASET", "DYN_BENCH_GIANT_KV_REPEATS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    rc = run(["--points", str(points), "--out", str(out), "--model", str(tmp_path / "no-model")])
    return rc, json.loads((out / "sweep.json").read_text())


@pytest.mark.parametrize(
    "points, env, message",
    [
        (None, {}, "not found"),
        ('{"schema_version": 1, "decode": [], "prefill": [{"total_prefill_tokens": 8}]}', {}, "batch_size must be"),
        (
            '{"schema_version": 1, "decode": [{"total_kv_read_tokens": 8, "batch_size": 1}]}',
            {},
            "DYN_BENCH_KV_WARMUP_DATASET is not set",
        ),
        (
            '{"schema_version": 1, "decode": [{"total_kv_read_tokens": 8, "batch_size": 1}]}',
            {"DYN_BENCH_KV_WARMUP_DATASET": "/nowhere/sharegpt.json"},
            "dataset /nowhere/sharegpt.json not found",
        ),
        (
            '{"schema_version": 1, "decode": [{"total_kv_read_tokens": 8, "batch_size": 1}]}',
            {"DYN_BENCH_KV_WARMUP": "sometimes"},
            "DYN_BENCH_KV_WARMUP='sometimes' is not one of",
        ),
        (
            '{"schema_version": 1, "decode": [{"total_kv_read_tokens": 8, "batch_size": 1}]}',
            {"DYN_BENCH_GIANT_KV_REPEATS": "many"},
            "DYN_BENCH_GIANT_KV_REPEATS='many' is not an integer",
        ),
    ],
)
def test_bad_input_stops_before_the_engine_with_a_message_and_an_artifact(
    tmp_path, monkeypatch, capsys, points, env, message
):
    path = tmp_path / "points.json"
    if points is not None:
        path.write_text(points)
    rc, artifact = _sweep(tmp_path, monkeypatch, path, env)
    assert rc == 2 and message in capsys.readouterr().err
    assert artifact["status"] == "failed" and message in artifact["error"] and artifact["results"] == []


@pytest.mark.parametrize(
    "grid, env, message",
    [
        # {} is a grid of the default caps (it was taken as "no grid", and Path(None) raised)
        ("{}", {"DYN_BENCH_KV_WARMUP": "sometimes"}, "DYN_BENCH_KV_WARMUP='sometimes' is not one of"),
        # caps are checked before the engine loads the model (they were, after)
        ('{"decode_batches": 0}', {"DYN_BENCH_KV_WARMUP": "off"}, "\"grid\": {'decode_batches': 0}: the grid takes"),
        ('{"capture_sizes": [1, "2"]}', {"DYN_BENCH_KV_WARMUP": "off"}, "capture_sizes"),
    ],
)
def test_a_grid_sweeps_input_is_checked_before_the_engine(tmp_path, monkeypatch, capsys, grid, env, message):
    from vllm.kvwarm.sweep.command import run

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    rc = run(["--grid", grid, "--out", str(out), "--model", str(tmp_path / "no-model")])
    artifact = json.loads((out / "sweep.json").read_text())
    assert rc == 2 and message in capsys.readouterr().err
    assert artifact["status"] == "failed" and message in artifact["error"]
    assert artifact["config"]["points"] == str(out / "grid.json")


def test_the_command_stops_waiting_when_the_engine_core_dies_without_a_final_artifact(tmp_path, capsys, monkeypatch):
    """Engine cores in vLLM's own processes: the command polls the artifact; when vLLM marks
    the engine dead (`resources.engine_dead`) before the artifact is final, it stops and
    says so. The engine client is a stand-in for vLLM's LLMEngine holding only what the wait
    reads (`engine_core.resources.engine_dead`): a real one needs engine core processes, which
    unit-S does not start (the CPU engine's tests do), and none can be made to die here."""
    from types import SimpleNamespace

    from vllm.kvwarm.sweep import command as sweep_command

    artifact = tmp_path / "sweep.json"
    artifact.write_text(json.dumps({"status": "running"}))
    resources = SimpleNamespace(engine_dead=False)
    polls = []

    def sleep(_seconds):
        polls.append(1)
        resources.engine_dead = len(polls) >= 3  # the core dies after a few polls

    engine_stand_in = SimpleNamespace(engine_core=SimpleNamespace(resources=resources))
    monkeypatch.setattr(sweep_command.time, "sleep", sleep)
    assert sweep_command._wait(engine_stand_in, ArtifactRows(artifact, None, share=1.0), None) == "engine died"
    assert len(polls) == 3 and "engine core died before the sweep's artifact was final" in capsys.readouterr().err


def test_the_command_waits_through_a_missing_or_half_replaced_artifact(tmp_path, monkeypatch):
    """The command's wait reads the artifact through its replacement: gone, half written,
    running, then complete. The engine client is a stand-in for vLLM's LLMEngine whose engine
    core lives on (`engine_core.resources.engine_dead` False, all the wait reads of it): a
    real one needs engine core processes, which unit-S does not start."""
    from types import SimpleNamespace

    from vllm.kvwarm.sweep import command as sweep_command

    artifact = tmp_path / "sweep.json"
    states = iter([None, "not json {", json.dumps({"status": "running"}), json.dumps({"status": "complete"})])

    def sleep(_seconds):
        state = next(states)
        if state is None:
            artifact.unlink(missing_ok=True)
        else:
            artifact.write_text(state)

    monkeypatch.setattr(sweep_command.time, "sleep", sleep)
    engine_stand_in = SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(engine_dead=False)))
    assert sweep_command._wait(engine_stand_in, ArtifactRows(artifact, None, share=1.0), None) == "complete"
