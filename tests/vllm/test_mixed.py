"""Mixed points (schema v2): the points file's `mixed` list and its errors, and mixed points
stepped against a real Scheduler (sync, and async in the order of vLLM's batch-queue loop),
the model runner's part played by the test: each timed step holds exactly the decode part's
shadows, one token each, and the prefill part's shot; its row, its artifact and its reader."""

from __future__ import annotations

import json

import pytest
from kvwarm_testing.rank_sweeps import launched
from kvwarm_testing.real_kv import EngineLoop, ManualClock, in_use, make_scheduler
from test_prefill import FORWARD_PER_TOKEN, STEPS, _hashing, _run, _sweep  # noqa: F401 (_hashing: autouse)
from vllm.kvwarm.kv.injector import SHADOW_PREFIX
from vllm.kvwarm.record import vocabulary as v
from vllm.kvwarm.record.artifact import KvwarmMeta, build_artifact, results_csv
from vllm.kvwarm.record.schema import validate
from vllm.kvwarm.record.validate.predict import MixedRow, read_mixed_rows
from vllm.kvwarm.scheduler import KvWarmAsyncScheduler, KvWarmScheduler
from vllm.kvwarm.sweep import prefill as prefill_module
from vllm.kvwarm.sweep.exchange.solo import SoloExchange
from vllm.kvwarm.sweep.limits import check_points
from vllm.kvwarm.sweep.points import (
    DecodePoint,
    MixedPoint,
    PointsFileError,
    PrefillPoint,
    check_budget,
    load_points,
)

MIXED = {
    "decode": {"total_kv_read_tokens": 200, "batch_size": 2},
    "prefill": {"total_prefill_tokens": 64, "total_kv_read_tokens": 32, "batch_size": 1},
}


def _write(tmp_path, data) -> str:
    path = tmp_path / "points.json"
    path.write_text(json.dumps(data))
    return str(path)


# --- the points file ---------------------------------------------------------------------------


def test_mixed_points_are_read_from_schema_2_beside_the_other_kinds(tmp_path):
    path = _write(
        tmp_path,
        {"schema_version": 2, "decode": [{"total_kv_read_tokens": 64, "batch_size": 2}], "mixed": [MIXED]},
    )
    points = load_points(path, max_model_len=1024, steady_steps=3)
    mixed = MixedPoint(DecodePoint(200, 2), PrefillPoint(64, 32, 1))
    assert points == [DecodePoint(64, 2), mixed]
    assert (mixed.batch_size, mixed.step_tokens) == (3, 66)
    # a file of schema 1 (Dynamo's shape) reads as before
    old = _write(tmp_path, {"schema_version": 1, "prefill": [{"total_prefill_tokens": 16, "batch_size": 1}]})
    assert load_points(old, max_model_len=1024, steady_steps=3) == [PrefillPoint(16, 0, 1)]


@pytest.mark.parametrize(
    "content, message",
    [
        ({"schema_version": 4, "mixed": [MIXED]}, r"schema_version is 4; this sweep reads schema_version 1 or 2 or 3"),
        ({"schema_version": 1, "mixed": [MIXED]}, r"'mixed' points need schema_version 2 or more; set it to 3"),
        ({"schema_version": 2, "mixed": [{"decode": MIXED["decode"]}]}, r"mixed\[0\]: expected an object with a"),
        (
            {"schema_version": 2, "mixed": [{**MIXED, "chunk": 1}]},
            r"mixed\[0\]: unknown key 'chunk' \(allowed: decode, prefill\)",
        ),
        (
            {"schema_version": 2, "mixed": [{**MIXED, "decode": {"total_kv_read_tokens": 1, "batch_size": 2}}]},
            r"mixed\[0\]\.decode: total_kv_read_tokens 1 is less than batch_size 2",
        ),
        (
            {"schema_version": 2, "mixed": [{**MIXED, "prefill": {"total_prefill_tokens": 0, "batch_size": 1}}]},
            r"mixed\[0\]\.prefill: total_prefill_tokens must be a positive integer",
        ),
        ({"schema_version": 2, "mixed": [MIXED, MIXED]}, r"mixed\[1\] repeats mixed\[0\]"),
        ({"schema_version": 2, "mixed": []}, r"'decode', 'prefill' and 'mixed' are all empty"),
    ],
)
def test_bad_mixed_points_name_the_entry_and_the_fix(tmp_path, content, message):
    with pytest.raises(PointsFileError, match=message):
        load_points(_write(tmp_path, content), max_model_len=1024, steady_steps=3)


def test_a_mixed_decode_part_must_fit_max_model_len_over_the_steps_its_shots_need(tmp_path):
    # context 500 + admission + 2 * (3 + 1) + 1 steps = 510 > 505
    path = _write(
        tmp_path, {"schema_version": 2, "mixed": [{**MIXED, "decode": {"total_kv_read_tokens": 500, "batch_size": 1}}]}
    )
    with pytest.raises(PointsFileError, match=r"mixed\[0\]\.decode: .* needs 510 tokens, beyond max_model_len 505"):
        load_points(path, max_model_len=505, steady_steps=3)


def test_a_mixed_point_over_the_token_budget_is_refused_naming_the_point_and_the_fix(tmp_path):
    point = MixedPoint(DecodePoint(200, 2), PrefillPoint(255, 32, 1))
    check_budget([point], None, "points.json")  # the engine's default budget: checked once it is known
    check_budget([point], 257, "points.json")
    with pytest.raises(PointsFileError) as err:
        check_budget([point], 256, "points.json")
    assert str(err.value) == (
        "points.json: mixed point decode B=2 K=200 + prefill B=1 N=255 P=32: its step computes 2 decode + 255 "
        "prefill = 257 tokens, beyond max_num_batched_tokens 256, so the engine would chunk the prefill part; lower "
        "N or the decode batch, or start the engine with --max-num-batched-tokens 257 or more"
    )


def test_the_engine_limits_refuse_mixed_points_it_cannot_run_as_one_step(tmp_path):
    scheduler = make_scheduler(tmp_path, num_blocks=128, max_num_batched_tokens=128)
    over = MixedPoint(DecodePoint(200, 2), PrefillPoint(127, 0, 1))
    with pytest.raises(PointsFileError, match="129 tokens, beyond max_num_batched_tokens 128"):
        check_points([over], scheduler.vllm_config, scheduler.kv_cache_manager, "points.json")
    check_points(
        [MixedPoint(DecodePoint(200, 2), PrefillPoint(126, 0, 1))],
        scheduler.vllm_config,
        scheduler.kv_cache_manager,
        "points.json",
    )
    with pytest.raises(PointsFileError, match=r"prefill point N=64 P=40 B=1: P must be a whole number of 16-token"):
        check_points(
            [MixedPoint(DecodePoint(200, 2), PrefillPoint(64, 40, 1))],
            scheduler.vllm_config,
            scheduler.kv_cache_manager,
            "points.json",
        )


@pytest.mark.parametrize(
    "state_mode, refusal",
    [
        ("exact", None),
        ("copy", None),
        ("inplace", "state mode inplace lends the chains' own state block to the decode part"),
        (None, "which a mixed point's decode part takes over on real KV only (exact state or copy), and this sweep"),
    ],
)
def test_mixed_points_on_recurrent_state_pass_where_the_sweep_hands_the_state_over(tmp_path, state_mode, refusal):
    hybrid = make_scheduler(tmp_path, num_blocks=128, block_size=64, state_block_size=64, hash_block_size=16)
    points = [MixedPoint(DecodePoint(200, 2), PrefillPoint(64, 0, 1))]
    args = (points, hybrid.vllm_config, hybrid.kv_cache_manager, "points.json")
    if refusal is None:
        check_points(*args, state_mode=state_mode)
        return
    with pytest.raises(PointsFileError) as err:
        check_points(*args, state_mode=state_mode)
    assert str(err.value).startswith("points.json: mixed point decode B=2 K=200 + prefill B=1 N=64 P=0: this model")
    assert refusal in str(err.value) and str(err.value).endswith("; drop the mixed points to sweep the rest")


def test_mixed_points_pass_the_checks_at_a_launched_data_parallel_size_of_two(tmp_path):
    """The ranks meet at every shot of a mixed point as of a prefill point (the two-rank sweep:
    tests/engine/test_multi_rank.py), so a launch of two ranks refuses none."""
    scheduler = make_scheduler(tmp_path, num_blocks=128)
    point = MixedPoint(DecodePoint(200, 2), PrefillPoint(64, 0, 1))
    budget = scheduler.vllm_config.scheduler_config.max_num_batched_tokens
    over = MixedPoint(DecodePoint(200, 2), PrefillPoint(budget - 1, 0, 1))  # two decode tokens beside
    with launched(2):
        check_points([point], scheduler.vllm_config, scheduler.kv_cache_manager, "points.json")
        with pytest.raises(PointsFileError, match=f"= {budget + 1} tokens, beyond max_num_batched_tokens {budget}"):
            check_points([over], scheduler.vllm_config, scheduler.kv_cache_manager, "points.json")


# --- the steps, on the real scheduler ------------------------------------------------------


def _composition(output) -> tuple:
    """(shadows, their tokens, shot requests, their new tokens, their hit, others) of a step."""
    scheduled = output.num_scheduled_tokens
    shadows = [i for i in scheduled if i.startswith(SHADOW_PREFIX)]
    shot = [r for r in output.scheduled_new_reqs if r.req_id.startswith(prefill_module.PREFILL_PREFIX)]
    others = set(scheduled) - set(shadows) - {r.req_id for r in shot}
    return (
        len(shadows),
        sorted({scheduled[i] for i in shadows}),
        len(shot),
        sum(scheduled[r.req_id] for r in shot),
        sum(r.num_computed_tokens for r in shot),
        len(others),
    )


@pytest.mark.parametrize(
    "cls, batch_queue", [(KvWarmScheduler, False), (KvWarmAsyncScheduler, True)], ids=["sync", "async-batch-queue"]
)
def test_a_mixed_point_runs_its_decodes_and_its_prefill_shot_in_one_timed_step(tmp_path, cls, batch_queue):
    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=cls)
    points = [  # rungs by chains, the larger part's batch, most first
        MixedPoint(DecodePoint(200, 2), PrefillPoint(64, 32, 1)),
        MixedPoint(DecodePoint(90, 3), PrefillPoint(40, 0, 2)),
    ]
    clock = ManualClock()  # moved only by the played model runner: FORWARD_PER_TOKEN per token
    loop = EngineLoop(scheduler, batch_queue, clock, lambda o: FORWARD_PER_TOKEN * o.total_num_scheduled_tokens)
    sweep = _sweep(points, clock)
    outputs = _run(scheduler, sweep, loop=loop)
    assert sweep.reset_prefix_cache_ok and in_use(scheduler.kv_cache_manager.block_pool) == {}
    rows = [(r.point, r.kv_seed_regime, r.sample_reasons, r.sample_kind, len(r.samples)) for r in sweep.rows]
    assert rows == [
        (
            {
                "point_type": "mixed",
                "total_kv_read_tokens": 90,
                "batch_size": 5,
                "total_prefill_tokens": 40,
                "decode": {"batch_size": 3, "total_kv_read_tokens": 90},
                "prefill": {"batch_size": 2, "total_prefill_tokens": 40, "total_kv_read_tokens": 0},
            },
            "real_kv",
            ["kvwarm_real_kv"],
            "shot_forward",
            STEPS,
        ),
        (
            {
                "point_type": "mixed",
                "total_kv_read_tokens": 232,
                "batch_size": 3,
                "total_prefill_tokens": 64,
                "decode": {"batch_size": 2, "total_kv_read_tokens": 200},
                "prefill": {"batch_size": 1, "total_prefill_tokens": 64, "total_kv_read_tokens": 32},
            },
            "real_kv",
            ["prefill_real_seed", "kvwarm_real_kv"],
            "shot_forward",
            STEPS,
        ),
    ]
    # Every step that ran a shot (the warm one and STEPS measured, per point) held exactly
    # the point's decode requests, one token each, and its prefill requests: B_p new ones
    # computing N tokens on a hit of P (vLLM's own counts), nothing else.
    mixed = [_composition(o) for o in outputs if _composition(o)[2]]
    assert mixed == [(3, [1], 2, 40, 0, 0)] * (1 + STEPS) + [(2, [1], 1, 64, 32, 0)] * (1 + STEPS)
    # each shadow was admitted alone (its admission step, untimed), before any shot
    first_shot = next(i for i, o in enumerate(outputs) if _composition(o)[2])
    admitted = [
        o for o in outputs[:first_shot] if any(r.req_id.startswith(SHADOW_PREFIX) for r in o.scheduled_new_reqs)
    ]
    assert len(admitted) == 1 and _composition(admitted[0])[:3] == (3, [1], 0)
    # a sample is the mixed step's forward: its decode tokens and its N, whichever loop
    for row, (decode_b, n) in zip(sweep.rows, [(3, 40), (2, 64)], strict=True):
        assert row.samples == pytest.approx([FORWARD_PER_TOKEN * (decode_b + n)] * STEPS)
        assert row.median_seconds == row.phases["forward"] == pytest.approx(FORWARD_PER_TOKEN * (decode_b + n))


def test_a_step_that_is_not_the_points_shape_skips_it_by_name(tmp_path):
    """A step that runs other than the decode part's requests at one token each is named: one
    of the two shadows is aborted from outside once they are admitted, so the shot's step runs
    the other alone beside the shot."""
    from vllm.v1.request import RequestStatus

    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=KvWarmScheduler)
    clock = ManualClock()
    sweep = _sweep([MixedPoint(DecodePoint(200, 2), PrefillPoint(64, 32, 1))], clock)
    scheduler.kvwarm_sweep = sweep
    loop = EngineLoop(scheduler, False, clock)
    aborted: list[str] = []
    for _ in range(600):
        if not loop.busy():
            break
        loop.step()
        shadows = sorted(r for r in scheduler.requests if r.startswith(SHADOW_PREFIX))
        if shadows and not aborted:
            aborted.append(shadows[0])
            scheduler.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)
    assert sweep.done and aborted
    (row,) = sweep.rows
    assert row.kv_seed_regime == v.skip_regime(v.BATCH_SIZE_MISMATCH)
    assert "the step ran 1 of the decode part's 2 request(s) at one token each" in row.detail
    assert sweep.reset_prefix_cache_ok and in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_mixed_points_on_fake_kv_run_the_same_step(tmp_path):
    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=KvWarmScheduler)
    clock = ManualClock()
    loop = EngineLoop(scheduler, False, clock, lambda o: FORWARD_PER_TOKEN * o.total_num_scheduled_tokens)
    sweep = _sweep([MixedPoint(DecodePoint(200, 2), PrefillPoint(64, 32, 1))], clock, real=False)
    outputs = _run(scheduler, sweep, loop=loop)
    (row,) = sweep.rows
    assert (row.kv_seed_regime, row.sample_reasons) == (
        "fake_fallback",
        ["prefill_fake_prefix", "kvwarm_fake_fallback"],
    )
    assert [_composition(o) for o in outputs if _composition(o)[2]] == [(2, [1], 1, 64, 32, 0)] * (1 + STEPS)
    assert sweep.reset_prefix_cache_ok and in_use(scheduler.kv_cache_manager.block_pool) == {}


def _hybrid(tmp_path, cls=KvWarmScheduler, num_blocks=192):
    """Attention and an align-mode state group, blocks of 32 tokens (the prefix unit too)."""
    return make_scheduler(tmp_path, num_blocks=num_blocks, scheduler_cls=cls, block_size=32, state_block_size=32)


@pytest.mark.parametrize(
    "cls, batch_queue", [(KvWarmScheduler, False), (KvWarmAsyncScheduler, True)], ids=["sync", "async-batch-queue"]
)
def test_an_exact_state_mixed_points_decode_part_borrows_from_parked_catch_ups(tmp_path, cls, batch_queue):
    """Exact state, as this build decides it: the decode part's shadows at contexts 98 (one
    short of 100, and one for the gap step before the first timed shot) borrow from catch-ups
    that find the chain's state at the boundary 96 and compute 2 tokens, parked there (never
    decoded), before any shot; every shot's step holds
    the two shadows at one token and the shot (24 new tokens on a hit of 64: within a state
    block, since vLLM's align mode stops a prefill at the last boundary before the prompt's
    end); the row carries a decode row's exact-state stamps."""
    from vllm.kvwarm.kv.layout import group_layouts
    from vllm.kvwarm.kv.state_mode import decide_state_mode

    scheduler = _hybrid(tmp_path, cls)
    decision = decide_state_mode(scheduler.kv_cache_manager, group_layouts(scheduler.kv_cache_manager), {})
    assert decision.mode == "exact"
    catchups = []
    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        output = schedule(*args, **kwargs)
        catchups.extend((r, n) for r, n in output.num_scheduled_tokens.items() if "catchup" in r)
        return output

    scheduler.schedule = recording_schedule
    clock = ManualClock()
    loop = EngineLoop(scheduler, batch_queue, clock, lambda o: FORWARD_PER_TOKEN * o.total_num_scheduled_tokens)
    point = MixedPoint(DecodePoint(200, 2), PrefillPoint(24, 64, 1))
    sweep = _sweep([point], clock, state_mode=decision.mode, state_lending=decision.lending)
    outputs = _run(scheduler, sweep, loop=loop)
    (row,) = sweep.rows
    assert (row.point["point_type"], row.kv_seed_regime) == ("mixed", "real_kv"), row.detail
    assert row.sample_reasons == ["prefill_real_seed", "kvwarm_real_kv", "kvwarm_state_exact", "kvwarm_state_depth=100"]
    assert sorted(n for _, n in catchups) == [2, 2]  # once each, from the boundary 96: never decoded
    assert [_composition(o) for o in outputs if _composition(o)[2]] == [(2, [1], 1, 24, 64, 0)] * (1 + STEPS)
    first_shot = next(i for i, o in enumerate(outputs) if _composition(o)[2])
    assert all(not any("catchup" in r for r in o.num_scheduled_tokens) for o in outputs[first_shot:])
    assert row.samples == pytest.approx([FORWARD_PER_TOKEN * 26] * STEPS)
    assert sweep.reset_prefix_cache_ok and in_use(scheduler.kv_cache_manager.block_pool) == {}
    assert not [r for r in scheduler.requests if "catchup" in r]


def test_a_copy_state_mixed_point_reads_the_chains_state_and_is_stamped_with_its_depth(tmp_path):
    """Copy: no catch-up; the shadows copy the chain's state at its whole depth (the decode
    part's context 99, the admission token and the 9 steps its requests run: 109)."""
    scheduler = _hybrid(tmp_path)
    clock = ManualClock()
    loop = EngineLoop(scheduler, False, clock, lambda o: FORWARD_PER_TOKEN * o.total_num_scheduled_tokens)
    sweep = _sweep([MixedPoint(DecodePoint(200, 2), PrefillPoint(24, 64, 1))], clock, state_mode="copy")
    outputs = _run(scheduler, sweep, loop=loop)
    (row,) = sweep.rows
    assert row.sample_reasons == ["prefill_real_seed", "kvwarm_real_kv", "kvwarm_state_copy", "kvwarm_state_depth=109"]
    assert [_composition(o) for o in outputs if _composition(o)[2]] == [(2, [1], 1, 24, 64, 0)] * (1 + STEPS)
    assert not any("catchup" in r for o in outputs for r in o.num_scheduled_tokens)
    assert sweep.reset_prefix_cache_ok and in_use(scheduler.kv_cache_manager.block_pool) == {}


class RecordingExchange(SoloExchange):
    """One rank's exchange (the real one), noting the kind of every meeting it is posted."""

    def __init__(self):
        self.kinds: list[str] = []

    def post(self, kind: str, record: dict) -> None:
        self.kinds.append(kind)
        super().post(kind, record)


def test_an_exact_mixed_point_whose_catch_ups_do_not_fit_is_skipped_by_name_and_the_next_runs(tmp_path, monkeypatch):
    """As if every boundary state had been evicted: each catch-up would recompute its whole
    context, which the pool cannot hold beside the chains, so the point is skipped, named,
    after the ranks meet, as a decode point is; the next point of the rung is measured."""
    from vllm.kvwarm.sweep import catchups

    scheduler = _hybrid(tmp_path, num_blocks=40)
    real_lookup = catchups.cached_tokens
    deep = MixedPoint(DecodePoint(600, 2), PrefillPoint(24, 64, 1))
    monkeypatch.setattr(
        catchups, "cached_tokens", lambda kvm, r: 0 if r.num_prompt_tokens == 298 else real_lookup(kvm, r)
    )
    exchange = RecordingExchange()
    points = [deep, MixedPoint(DecodePoint(60, 2), PrefillPoint(24, 0, 1))]
    sweep = _sweep(points, exchange=exchange, state_mode="exact", state_lending="copy")
    _run(scheduler, sweep, loop=EngineLoop(scheduler, False, ManualClock()))
    skipped, measured = sweep.rows
    assert skipped.kv_seed_regime == "skip:decode_injection_failed" and "pool_exhausted" in skipped.detail
    assert skipped.point == {
        "point_type": "mixed",
        "total_kv_read_tokens": 664,
        "batch_size": 3,
        "total_prefill_tokens": 24,
        "decode": {"batch_size": 2, "total_kv_read_tokens": 600},
        "prefill": {"batch_size": 1, "total_prefill_tokens": 24, "total_kv_read_tokens": 64},
    }
    assert measured.kv_seed_regime == "real_kv", measured.detail
    assert exchange.kinds.count("caught_up") == 2  # the skipped point's meeting too
    assert sweep.reset_prefix_cache_ok and in_use(scheduler.kv_cache_manager.block_pool) == {}


# --- the row in the artifact, and its reader -----------------------------------------------


def test_a_mixed_row_is_in_the_artifact_and_csv_and_read_back_by_the_predictor(tmp_path):
    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=KvWarmScheduler)
    clock = ManualClock()
    loop = EngineLoop(scheduler, False, clock, lambda o: FORWARD_PER_TOKEN * o.total_num_scheduled_tokens)
    sweep = _sweep([MixedPoint(DecodePoint(200, 2), PrefillPoint(64, 32, 1))], clock)
    _run(scheduler, sweep, loop=loop)
    artifact = build_artifact(sweep.rows, KvwarmMeta(), {"points": "p"}, v.COMPLETE)
    validate(artifact)
    (result,) = artifact["results"]
    (read,) = read_mixed_rows(artifact)
    phases = {name: ms * 1e3 for name, ms in result["phases"].items()}
    assert read == MixedRow(
        2, 200, 1, 64, 32, pytest.approx(sum(phases.values())), {**phases, "forward": pytest.approx(66.0)}
    )
    header, line = results_csv(artifact["results"]).decode().splitlines()
    cells = dict(zip(header.split(","), line.split(",")))
    assert {k: cells[k] for k in ("point_type", "total_kv_read_tokens", "batch_size", "total_prefill_tokens")} == {
        "point_type": "mixed",
        "total_kv_read_tokens": "232",
        "batch_size": "3",
        "total_prefill_tokens": "64",
    }
    assert (cells["decode_batch_size"], cells["decode_kv_read_tokens"]) == ("2", "200")
