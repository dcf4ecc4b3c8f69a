"""Resuming a stopped sweep (sweep.resume) on one rank: SweepRuns configured as the adapter
builds them (`"resume": true`) on real Schedulers, the model runner's part played by the test,
fake KV (the warm-up off: no dataset or tokenizer). A first boot stops after some rows (the
process is gone: nothing more is written) with its sweep.json behind its rows.jsonl; the
resumed boot keeps every row, measures each other point once, and records its boots. A
resume against a changed plan or engine is refused by name, keeping the first boot's record;
the sweep command refuses what it can before the engine starts."""

from __future__ import annotations

import json
import shutil

import pytest
from kvwarm_testing.real_kv import make_scheduler, step_scheduler
from vllm.kvwarm.record.schema import validate
from vllm.kvwarm.scheduler import KvWarmScheduler
from vllm.kvwarm.sweep import command
from vllm.kvwarm.sweep.resume import ResumeError

POINTS = [(400, 2), (300, 2), (200, 2), (90, 3), (60, 3)]


@pytest.fixture(autouse=True)
def _fake_kv(monkeypatch):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    monkeypatch.delenv("DYN_BENCH_KV_WARMUP_DATASET", raising=False)


def _points(tmp_path, points=POINTS) -> str:
    path = tmp_path / "points.json"
    path.write_text(
        json.dumps({"schema_version": 1, "decode": [{"total_kv_read_tokens": k, "batch_size": b} for k, b in points]})
    )
    return str(path)


def _launch(tmp_path, resume: bool = False, **engine):
    spec = {
        "points": str(tmp_path / "points.json"),
        "out": str(tmp_path / "out"),
        **({"resume": True} if resume else {}),
    }
    config = {"num_blocks": 128, **engine}
    return make_scheduler(
        tmp_path / "engine", scheduler_cls=KvWarmScheduler, additional_config={"kvwarm_sweep": spec}, **config
    )


def _drive(scheduler, rows: int | None = None) -> None:
    """Step until the sweep has `rows` rows (None: to its end)."""
    for _ in range(2000):
        sweep = scheduler.kvwarm_sweep
        if (rows is not None and len(sweep.rows) >= rows) or not scheduler.has_requests():
            return
        step_scheduler(scheduler)
    raise AssertionError("the sweep did not get there")


def _stopped(tmp_path, rows: int = 3) -> dict:
    """A first boot stopped after `rows` rows, its sweep.json as it stood after the first
    (a paced rewrite left out since); returns the rows as that boot measured them."""
    _points(tmp_path)
    scheduler = _launch(tmp_path)
    _drive(scheduler, 1)
    lagging = (tmp_path / "out" / "sweep.json").read_bytes()
    _drive(scheduler, rows)
    measured = {(r.total_kv_read_tokens, r.batch_size): r.median_seconds for r in scheduler.kvwarm_sweep.rows}
    (tmp_path / "out" / "sweep.json").write_bytes(lagging)
    return measured


def _keys(artifact: dict) -> list[tuple]:
    return [(r["point"]["total_kv_read_tokens"], r["point"]["batch_size"]) for r in artifact["results"]]


def test_a_resumed_sweep_keeps_every_row_and_measures_every_other_point_once(tmp_path):
    before = _stopped(tmp_path, rows=3)
    assert len(json.loads((tmp_path / "out" / "sweep.json").read_text())["results"]) == 1  # behind its rows
    _drive(_launch(tmp_path, resume=True))
    artifact = json.loads((tmp_path / "out" / "sweep.json").read_text())
    validate(artifact)
    assert artifact["status"] == "complete" and artifact["skipped_points"] == []
    assert sorted(_keys(artifact)) == sorted(POINTS) and len(set(_keys(artifact))) == len(POINTS)
    kept = {k: r["median_seconds"] for k, r in zip(_keys(artifact), artifact["results"]) if k in before}
    assert kept == before  # the first boot's rows, as it measured them
    meta = artifact["kvwarm"]
    assert [(b["boot"], b["rows"]) for b in meta["boots"]] == [(0, 3), (1, 2)]
    assert meta["resume"] == {"replaced": []} and meta["plan"]["points_digest"]
    lines = [json.loads(line) for line in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    assert [(line["kind"], line["boot"]) for line in lines if line["kind"] != "row"] == [("boot", 0), ("boot", 1)]
    assert [line["done"] for line in lines if line["kind"] == "row"] == [1, 2, 3, 4, 5]


def test_a_resume_of_a_complete_sweep_measures_nothing_again(tmp_path):
    _points(tmp_path)
    _drive(_launch(tmp_path))
    first = json.loads((tmp_path / "out" / "sweep.json").read_text())
    _drive(_launch(tmp_path, resume=True))
    again = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert again["status"] == "complete" and again["results"] == first["results"]
    assert [(b["boot"], b["rows"]) for b in again["kvwarm"]["boots"]] == [(0, 5), (1, 0)]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ("points", "the points file's content (--points) (points_sha256"),
        ("repeats", "DYN_BENCH_GIANT_KV_REPEATS (steady_steps: first boot 3, now 4)"),
        ("engine", "resolved.max_num_batched_tokens (first boot 256, now 512)"),
    ],
)
def test_a_resume_against_a_changed_plan_or_engine_is_refused_by_name(tmp_path, monkeypatch, change, needle):
    _stopped(tmp_path, rows=2)
    engine = {}
    if change == "points":
        _points(tmp_path, [*POINTS, (30, 3)])
    elif change == "repeats":
        monkeypatch.setenv("DYN_BENCH_GIANT_KV_REPEATS", "4")
    else:
        engine["max_num_batched_tokens"] = 512
    with pytest.raises(ResumeError) as refused:
        _launch(tmp_path, resume=True, **engine)
    assert needle in str(refused.value) and "without --resume" in str(refused.value)
    artifact = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert artifact["status"] == "failed" and needle in artifact["error"]
    assert len(artifact["results"]) == 2  # every row of its rows.jsonl, folded in
    assert artifact["config"]["engine_args"]["resolved"]["max_num_batched_tokens"] == 256  # the first boot's
    # the same plan again resumes it to the end
    _points(tmp_path)
    monkeypatch.delenv("DYN_BENCH_GIANT_KV_REPEATS", raising=False)
    _drive(_launch(tmp_path, resume=True))
    artifact = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert artifact["status"] == "complete" and sorted(_keys(artifact)) == sorted(POINTS)
    assert [(b["boot"], b["rows"]) for b in artifact["kvwarm"]["boots"]] == [
        (0, 2),
        (1, 3),
    ]  # the refused boot measured nothing and left no line


def test_a_resume_of_a_folder_without_a_sweep_is_refused(tmp_path):
    _points(tmp_path)
    with pytest.raises(ResumeError, match="holds no sweep to resume"):
        _launch(tmp_path, resume=True)


def _command(tmp_path, *extra: str) -> int:
    model = tmp_path / "engine" / "tiny-llama"
    return command.run(
        [
            "--points",
            str(tmp_path / "points.json"),
            "--out",
            str(tmp_path / "out"),
            "--resume",
            *extra,
            "--model",
            str(model),
        ]
    )


def test_the_command_refuses_a_resume_before_the_engine_starts_and_leaves_the_record(
    tmp_path, capsys, monkeypatch, engine_cli
):
    _points(tmp_path)
    assert _command(tmp_path) == 2  # nothing there yet
    assert "holds no sweep to resume" in capsys.readouterr().err and not (tmp_path / "out").exists()
    _stopped(tmp_path, rows=2)
    record = (tmp_path / "out" / "sweep.json").read_bytes()
    _points(tmp_path, POINTS[:4])
    assert _command(tmp_path) == 2
    assert "the points file's content (--points)" in capsys.readouterr().err
    _points(tmp_path)
    other = tmp_path / "other" / "tiny-qwen"
    shutil.copytree(tmp_path / "engine" / "tiny-llama", other)
    assert (
        command.run(
            [
                "--points",
                str(tmp_path / "points.json"),
                "--out",
                str(tmp_path / "out"),
                "--resume",
                "--model",
                str(other),
            ]
        )
        == 2
    )
    assert "the model (--model: first boot 'tiny-llama', now 'tiny-qwen')" in capsys.readouterr().err
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP_SETTLE_STEPS", "2")
    assert _command(tmp_path) == 2
    assert "DYN_BENCH_KV_WARMUP_SETTLE_STEPS (settle_steps: first boot 0, now 2)" in capsys.readouterr().err
    monkeypatch.delenv("DYN_BENCH_KV_WARMUP_SETTLE_STEPS")
    built = json.loads(record)
    built["build"] = {**(built["build"] or {}), "version": "0.0.0+another"}
    (tmp_path / "out" / "sweep.json").write_text(json.dumps(built))
    assert _command(tmp_path) == 2
    assert "the build (version: first boot '0.0.0+another'" in capsys.readouterr().err
    (tmp_path / "out" / "sweep.json").write_bytes(record)
    assert _command(tmp_path, "--ab") == 2
    assert "--ab measures every point on real and fake KV: unset DYN_BENCH_KV_WARMUP=off" in capsys.readouterr().err
    assert (tmp_path / "out" / "sweep.json").read_bytes() == record  # never rewritten by a refusal


def test_the_command_says_a_complete_sweep_has_nothing_to_resume(tmp_path, capsys, engine_cli):
    _points(tmp_path)
    _drive(_launch(tmp_path))
    record = (tmp_path / "out" / "sweep.json").read_bytes()
    assert _command(tmp_path) == 0
    assert "the sweep is complete (5 row(s)); nothing to resume" in capsys.readouterr().out
    assert (tmp_path / "out" / "sweep.json").read_bytes() == record


PLAN = {
    "points_sha256": "a" * 64,
    "grid": None,
    "grid_from": False,
    "grid_caps": None,
    "grid_skip_seconds": None,
    "warmup": "on",
    "steady_steps": 3,
    "settle_steps": 0,
    "giant_kv_threshold": 1_000_000,
    "gc_hold": True,
    "state_mode": None,
    "ab": False,
}


@pytest.mark.parametrize("field", sorted(PLAN))
def test_every_input_of_the_plan_that_differs_is_named_with_what_sets_it(field):
    from vllm.kvwarm.sweep.resume import SET_BY, check_plan

    build = {"version": "1+kvwarm.2", "flavour": "cpu", "series_digest": "s", "overlay_digest": "o"}
    first = {"kvwarm": {"plan": PLAN, "dataset": {"sha256": "d" * 64}}, "config": {"model": "/m/tiny"}, "build": build}
    check_plan(first, "out", dict(PLAN), "/elsewhere/tiny", build, {"sha256": "d" * 64})  # the same plan: resumed
    changed = {**PLAN, field: {"ab": True, "gc_hold": False, "grid_from": True}.get(field, "other")}
    with pytest.raises(ResumeError) as refused:
        check_plan(first, "out", changed, "/m/tiny", build, {"sha256": "d" * 64})
    assert f"{SET_BY[field]} ({field}: first boot {PLAN[field]!r}, now {changed[field]!r})" in str(refused.value)
    with pytest.raises(ResumeError, match=r"the dataset's content \(DYN_BENCH_KV_WARMUP_DATASET"):
        check_plan(first, "out", dict(PLAN), "/m/tiny", build, {"sha256": "e" * 64})
