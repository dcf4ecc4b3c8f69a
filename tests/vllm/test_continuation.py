"""Continuation prefill points (schema v3): a prompt's later chunk, its requests running on a
prefix their own lead step computed. The points file's field and its errors, the limits, and
the shots stepped against a real Scheduler (vLLM's sync loop and its batch queue), the model
runner's part played by the test: each shot a lead step of its requests alone (u tokens
each, u the prefix unit) and then its timed step (the same requests, running, N new tokens
on P computed), alone or beside a mixed point's decodes; and validate predicting the steps
that continue a prompt from continuation rows."""

from __future__ import annotations

import json

import pytest
from kvwarm_testing.rank_sweeps import launched
from kvwarm_testing.real_kv import BLOCK_SIZE, EngineLoop, ManualClock, in_use, make_scheduler
from kvwarm_testing.traces import step, write_table, write_trace
from test_prefill import FORWARD_PER_TOKEN, STEPS, _hashing, _run, _sweep  # noqa: F401 (_hashing: autouse)
from test_validate import DECODE_ROWS, PREFILL_ROWS, predictor, prefill
from vllm.kvwarm.kv.injector import SHADOW_PREFIX
from vllm.kvwarm.record.artifact import PointRow
from vllm.kvwarm.record.runs import from_artifact
from vllm.kvwarm.record.validate.predict import MixedRow, read_mixed_rows
from vllm.kvwarm.record.validate.validation import validate
from vllm.kvwarm.scheduler import KvWarmAsyncScheduler, KvWarmScheduler
from vllm.kvwarm.sweep import prefill as prefill_module
from vllm.kvwarm.sweep.grid import points_file
from vllm.kvwarm.sweep.limits import check_points
from vllm.kvwarm.sweep.points import DecodePoint, MixedPoint, PointsFileError, PrefillPoint, load_points

LOOPS = pytest.mark.parametrize(
    "cls, batch_queue", [(KvWarmScheduler, False), (KvWarmAsyncScheduler, True)], ids=["sync", "batch-queue"]
)
ENTRY = {"total_prefill_tokens": 48, "total_kv_read_tokens": 64, "batch_size": 2, "continuation": True}


def _load(tmp_path, data) -> list:
    path = tmp_path / "points.json"
    path.write_text(json.dumps(data))
    return load_points(path, max_model_len=1024, steady_steps=STEPS)


def _shot_parts(output) -> tuple:
    """(new shot requests, their tokens, their hit; running shot requests, their tokens,
    their computed tokens before the step; shadows) of one step, from vLLM's own output."""
    scheduled = output.num_scheduled_tokens
    new = [r for r in output.scheduled_new_reqs if r.req_id.startswith(prefill_module.PREFILL_PREFIX)]
    cached = output.scheduled_cached_reqs
    running = [
        (i, n)
        for i, n in zip(cached.req_ids, cached.num_computed_tokens)
        if i.startswith(prefill_module.PREFILL_PREFIX)
    ]
    return (
        len(new),
        sum(scheduled[r.req_id] for r in new),
        sum(r.num_computed_tokens for r in new),
        len(running),
        sum(scheduled[i] for i, _ in running),
        sum(n for _, n in running),
        sum(i.startswith(SHADOW_PREFIX) for i in scheduled),
    )


def _measure(tmp_path, cls, batch_queue, points):
    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=cls)
    threshold = scheduler.scheduler_config.long_prefill_token_threshold
    clock = ManualClock()  # moved only by the played model runner: FORWARD_PER_TOKEN per token
    loop = EngineLoop(scheduler, batch_queue, clock, lambda o: FORWARD_PER_TOKEN * o.total_num_scheduled_tokens)
    sweep = _sweep(points, clock)
    outputs = _run(scheduler, sweep, loop=loop)
    assert sweep.reset_prefix_cache_ok and in_use(scheduler.kv_cache_manager.block_pool) == {}
    # the lead steps' chunk cap is lifted: the engine's threshold is its own again
    assert scheduler.scheduler_config.long_prefill_token_threshold == threshold
    return sweep.rows, [_shot_parts(o) for o in outputs if o.total_num_scheduled_tokens]


# --- the points file and the limits ---------------------------------------------------------------


def test_continuation_points_are_read_from_schema_3_and_written_by_the_grid(tmp_path):
    points = _load(tmp_path, {"schema_version": 3, "prefill": [ENTRY, {**ENTRY, "continuation": False}]})
    assert points == [PrefillPoint(48, 64, 2, continuation=True), PrefillPoint(48, 64, 2)]
    assert points[0].lead(BLOCK_SIZE) == BLOCK_SIZE and points[1].lead(BLOCK_SIZE) == 0
    data = points_file(points)
    assert data["schema_version"] == 3 and data["prefill"][0]["continuation"] is True
    assert "continuation" not in data["prefill"][1]
    assert points_file(points[1:])["schema_version"] == 1  # Dynamo's shape where nothing needs more


@pytest.mark.parametrize(
    "data, message",
    [
        ({"schema_version": 2, "prefill": [ENTRY]}, r"prefill\[0\]: continuation needs schema_version 3; set it to 3"),
        (
            {"schema_version": 3, "prefill": [{**ENTRY, "total_kv_read_tokens": 0}]},
            r"prefill\[0\]: a continuation continues the P tokens .* give total_kv_read_tokens > 0",
        ),
        ({"schema_version": 3, "prefill": [{**ENTRY, "continuation": 1}]}, "continuation must be true or false"),
        (
            {"schema_version": 3, "mixed": [{"decode": {"total_kv_read_tokens": 90, "batch_size": 3}, "prefill": {}}]},
            r"mixed\[0\]\.prefill: total_prefill_tokens must be a positive integer",
        ),
    ],
)
def test_bad_continuation_entries_name_the_entry_and_the_fix(tmp_path, data, message):
    with pytest.raises(PointsFileError, match=message):
        _load(tmp_path, data)


def test_the_limits_refuse_continuations_without_chunked_prefill_or_beside_other_ranks(tmp_path, monkeypatch):
    scheduler = make_scheduler(tmp_path, num_blocks=128)
    point = PrefillPoint(48, 64, 2, continuation=True)
    check_points([point], scheduler.vllm_config, scheduler.kv_cache_manager, "points.json")
    monkeypatch.setattr(scheduler.vllm_config.scheduler_config, "enable_chunked_prefill", False)
    with pytest.raises(PointsFileError, match=r"N=48 P=64 B=2 \(continuation\): .* --enable-chunked-prefill"):
        check_points([point], scheduler.vllm_config, scheduler.kv_cache_manager, "points.json")
    monkeypatch.setattr(scheduler.vllm_config.scheduler_config, "enable_chunked_prefill", True)
    small = make_scheduler(tmp_path / "small", num_blocks=128, max_num_batched_tokens=64)
    wide = PrefillPoint(20, 5 * BLOCK_SIZE, 5, continuation=True)  # 5 lead chunks of 16 > 64
    with pytest.raises(
        PointsFileError, match="lower batch_size to 4 or start the engine with --max-num-batched-tokens 80"
    ):
        check_points([wide], small.vllm_config, small.kv_cache_manager, "points.json")
    with launched(2), pytest.raises(PointsFileError, match="sweep them with --data-parallel-size 1"):
        check_points([point], scheduler.vllm_config, scheduler.kv_cache_manager, "points.json")
    with launched(2):
        check_points([PrefillPoint(48, 64, 2)], scheduler.vllm_config, scheduler.kv_cache_manager, "points.json")


# --- the steps, on the real scheduler -------------------------------------------------------------


@LOOPS
def test_a_continuation_shot_is_a_lead_step_then_its_running_requests_timed_step(tmp_path, cls, batch_queue):
    points = [PrefillPoint(48, 64, 2, continuation=True), PrefillPoint(30, 16, 1, continuation=True)]
    rows, steps = _measure(tmp_path, cls, batch_queue, points)
    assert [(r.point, r.kv_seed_regime, len(r.samples)) for r in rows] == [
        (
            {
                "point_type": "prefill",
                "total_kv_read_tokens": 64,
                "batch_size": 2,
                "total_prefill_tokens": 48,
                "continuation": True,
            },
            "real_prefix",
            STEPS,
        ),
        (
            {
                "point_type": "prefill",
                "total_kv_read_tokens": 16,
                "batch_size": 1,
                "total_prefill_tokens": 30,
                "continuation": True,
            },
            "real_prefix",
            STEPS,
        ),
    ]
    assert rows[0].split == {"prefix_tokens": [32, 32], "new_tokens": [24, 24]}
    # every shot (warm and timed): a lead step of its B new requests, u tokens each on a hit
    # of P - B u, then a step of the same B requests, running, N tokens on P computed
    shots = [s for s in steps if s[0] or s[3]]
    lead, timed = (2, 2 * BLOCK_SIZE, 64 - 2 * BLOCK_SIZE, 0, 0, 0, 0), (0, 0, 0, 2, 48, 64, 0)
    small = [(1, BLOCK_SIZE, 0, 0, 0, 0, 0), (0, 0, 0, 1, 30, 16, 0)]
    assert shots == [lead, timed] * (1 + STEPS) + small * (1 + STEPS)
    # a sample is the timed step's own forward (N tokens' worth), not its lead's, whichever loop
    for row in rows:
        assert row.samples == pytest.approx([FORWARD_PER_TOKEN * row.total_prefill_tokens] * STEPS)


@LOOPS
@pytest.mark.parametrize("prefill_b", [1, 2])
def test_a_mixed_points_continuation_runs_beside_the_decodes_and_its_lead_runs_alone(
    tmp_path, cls, batch_queue, prefill_b
):
    """One request: vLLM lifts its long-prefill threshold for a lone eligible request, and the
    held shadows must not count as eligible, or the lead step would run the whole prompt."""
    point = MixedPoint(DecodePoint(90, 3), PrefillPoint(40, 32, prefill_b, continuation=True))
    rows, steps = _measure(tmp_path, cls, batch_queue, [point])
    (row,) = rows
    assert row.parts == {
        "decode": {"batch_size": 3, "total_kv_read_tokens": 90},
        "prefill": {
            "batch_size": prefill_b,
            "total_prefill_tokens": 40,
            "total_kv_read_tokens": 32,
            "continuation": True,
        },
    }
    assert "continuation" not in {k for k in row.point if k != "prefill"} and len(row.samples) == STEPS
    shots = [s for s in steps if s[0] or s[3]]
    # the lead step holds the shot alone; its timed step the three shadows one token each beside it
    lead = (prefill_b, prefill_b * BLOCK_SIZE, 32 - prefill_b * BLOCK_SIZE, 0, 0, 0, 0)
    assert shots == [lead, (0, 0, 0, prefill_b, 40, 32, 3)] * (1 + STEPS)
    # no gap step (the shadows alone) before a continuation's shots: its lead step runs there
    assert (0, 0, 0, 0, 0, 0, 3) not in steps[steps.index(lead) :]
    assert row.samples == pytest.approx([FORWARD_PER_TOKEN * (3 + 40)] * STEPS)


def test_a_lead_step_the_engine_did_not_cap_skips_the_point_by_name(tmp_path, monkeypatch):
    from vllm.kvwarm.kv.catchup import PrefillChunkCap
    from vllm.kvwarm.record import vocabulary as v

    monkeypatch.setattr(PrefillChunkCap, "apply", lambda self: None)  # the engine chunks as it likes
    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=KvWarmScheduler)
    clock = ManualClock()
    sweep = _sweep([PrefillPoint(48, 64, 2, continuation=True)], clock)
    _run(scheduler, sweep, loop=EngineLoop(scheduler, False, clock))
    (row,) = sweep.rows
    assert row.kv_seed_regime == v.skip_regime(v.PREFILL_TOKENS_MISMATCH)
    assert "the lead step computed [40, 40] token(s), 16 each wanted" in row.detail
    assert sweep.reset_prefix_cache_ok and in_use(scheduler.kv_cache_manager.block_pool) == {}


# --- validate: continuing steps from continuation rows ------------------------------------------


def continued(row: PointRow) -> PointRow:
    row.continuation = True
    return row


def test_continuation_steps_are_predicted_from_continuation_rows_where_the_table_has_them(tmp_path):
    new = [prefill(100, 1000, 1, 7), prefill(300, 1000, 1, 13)]  # whole steps 8 / 14 ms
    going_on = [continued(prefill(100, 1000, 1, 9)), continued(prefill(300, 1000, 1, 17))]  # 10 / 18 ms
    # a chunk of a new request (11 ms: halfway on the new rows) and one that continues its
    # prompt (14 ms: halfway on the continuation rows); a step of one of each is not a continuation
    steps = [
        step(0, 11.0, prefill=(1, 200, 1000)),
        step(1, 14.0, prefill=(1, 200, 1000), continuations=1),
        step(2, 11.0, prefill=(2, 400, 2000), continuations=1),
    ]
    trace = write_trace(tmp_path / "trace", steps)
    both = validate(str(write_table(tmp_path / "both", DECODE_ROWS + new + going_on)), str(trace.parent))
    assert both.kinds()["prefill"]["mape"] == pytest.approx(0.0) and both.kinds()["prefill"]["steps"] == 3
    # without continuation rows the continuing chunk is read off the new rows: 11 against 14
    plain = validate(str(write_table(tmp_path / "plain", DECODE_ROWS + new)), str(trace.parent))
    assert plain.kinds()["prefill"]["mape"] == pytest.approx(100 * 3 / 14 / 3)
    # the rows are apart in the artifact: the plain reader skips them, the mixed ones carry it
    artifact = json.loads((tmp_path / "both" / "sweep.json").read_text())
    assert len(from_artifact(artifact, "t", "t").rows) == len(DECODE_ROWS) + 2
    mixed_part = {"batch_size": 1, "total_prefill_tokens": 300, "total_kv_read_tokens": 0, "continuation": True}
    row = {
        "point": {
            "point_type": "mixed",
            "decode": {"batch_size": 2, "total_kv_read_tokens": 100},
            "prefill": mixed_part,
        },
        "median_seconds": 0.03,
    }
    assert read_mixed_rows({"results": [row]})[0].continuation is True


def test_continuation_mixed_rows_predict_only_continuing_mixed_steps():
    rows = [MixedRow(2, 100, 1, 100, 0, 20.0, {}), MixedRow(2, 100, 1, 100, 0, 26.0, {}, continuation=True)]
    p = predictor(DECODE_ROWS + PREFILL_ROWS, rows)
    assert p.mixed_step(2, 100, 1, 100, 0).ms == pytest.approx(20.0)
    assert p.mixed_step(2, 100, 1, 100, 0, continuation=True).ms == pytest.approx(26.0)
    assert p.kinds()["mixed"] == "measured"
