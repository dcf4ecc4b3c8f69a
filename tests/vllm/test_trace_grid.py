"""`sweep --grid-from TRACE`: the axes laid over a trace's shapes (ends, graph boundaries,
density), a grid under which the predictor reads every traced step without extrapolating
(mixed steps from mixed points laid over them), the engine's limits kept, and a trace of
another engine refused: before the engine loads where the command's arguments tell, and on
a real Scheduler against what it resolved."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
from kvwarm_testing.real_kv import in_use, make_scheduler, step_scheduler
from kvwarm_testing.traces import header, step, write_trace
from vllm.kvwarm.record.runs import Row
from vllm.kvwarm.record.shape import GraphConfig
from vllm.kvwarm.record.trace.reader import Step, TraceError
from vllm.kvwarm.record.validate.predict import MixedRow, Predictor
from vllm.kvwarm.sweep.grid import GridLimits, deepest_kv
from vllm.kvwarm.sweep.points import DecodePoint, MixedPoint, PrefillPoint
from vllm.kvwarm.sweep.settings import SettingsError
from vllm.kvwarm.sweep.trace_grid import (
    TRACE_CAPS,
    Shapes,
    caps_of,
    decode_points,
    mixed_points,
    prefill_points,
    shapes,
    spread,
    trace_grid,
)

SIZES = (1, 2, 4, 8, 16, 32, 64)
GRAPHS = GraphConfig("FULL_AND_PIECEWISE", "FULL", "PIECEWISE", SIZES, SIZES, SIZES, 64, 512)
LIMITS = GridLimits(
    max_model_len=4096, steady_steps=3, kv_cache_tokens=400_000, num_blocks=25_000, block_size=16, prefix_unit=16
)


def decode_step(b: int, k: int) -> Step:
    return Step(0, 0, 0.01, {}, b, k, 0, 0, 0)


def prefill_step(b: int, n: int, p: int) -> Step:
    return Step(0, 0, 0.01, {}, 0, 0, b, n, p)


def test_an_axis_holds_its_ends_the_graph_boundaries_inside_and_quantiles_where_values_are_dense():
    values = [9] * 10 + [10] * 10 + [11] * 10 + [12] * 10 + [40] * 2
    # ends 9 and 40; capture sizes inside with C + 1: 16, 17, 32, 33; two quantiles (at a third
    # and two thirds of the 42 sorted values: indices 14 and 27) fill the cap of 8
    assert spread(values, (8, 16, 32), 1, 64, 8) == [9, 10, 11, 16, 17, 32, 33, 40]
    assert spread([3, 100], (), 5, 50, 4) == [5, 50]  # clamped to the limits
    assert spread([7], SIZES, 1, 64, 6) == [7]
    assert spread([5, 3, 5, 9, 9, 9], (8,), 1, 64, 6) == [3, 5, 8, 9]  # every value fits the cap


def traced_steps() -> list[Step]:
    """Decode steps of every batch from 3 to 30 (more than the batch axis holds, so most read
    two neighbours' curves) across the capture sizes 8, 16 and 32, with contexts of 50 to
    3000 tokens; prefill chunks of one and three requests with and without a prefix; mixed."""
    steps = []
    for i in range(840):
        b = 3 + i % 28
        steps.append(decode_step(b, b * (50 + (i * 37) % 2950)))
    for i in range(90):
        b = (1, 1, 3)[i % 3]
        steps.append(prefill_step(b, b * (20 + (i * 53) % 150), b * 16 * ((i * 7) % 40)))
    steps += [Step(0, 0, 0.01, {}, 5, 5 * 200, 1, 300, 64), Step(0, 0, 0.01, {}, 9, 9 * 900, 1, 100, 0)]
    return steps


def table_over(points: list) -> Predictor:
    """A table measured at the points (values from any smooth function: only coverage matters)."""
    rows, mixed = [], []
    for p in points:
        if isinstance(p, MixedPoint):
            d, f = p.decode, p.prefill
            ms = 1 + d.total_kv_read_tokens / 1e3 + f.total_prefill_tokens / 1e2
            mixed.append(
                MixedRow(
                    d.batch_size,
                    d.total_kv_read_tokens,
                    f.batch_size,
                    f.total_prefill_tokens,
                    f.total_kv_read_tokens,
                    ms,
                    {},
                )
            )
        elif isinstance(p, DecodePoint):
            rows.append(
                Row(p.total_kv_read_tokens, p.batch_size, "legacy", [], 1 + p.total_kv_read_tokens / 1e3, 0, 0, [])
            )
        else:
            ms = 1 + p.total_prefill_tokens / 1e2
            phases = dict.fromkeys(("schedule", "forward", "update", "sweep", "other"), ms / 5)
            rows.append(
                Row(
                    p.total_kv_read_tokens,
                    p.batch_size,
                    "fake_prefix",
                    [],
                    ms,
                    0,
                    0,
                    [],
                    kind="prefill",
                    n=p.total_prefill_tokens,
                    phases_ms=phases,
                )
            )
    return Predictor(rows, mixed)


def test_the_grid_over_a_small_trace_is_the_one_worked_out_by_hand():
    """Decode steps (3, 600) and (12, 6000), prefill steps (1, 100, 0) and (1, 200, 32), and a
    mixed step of 2 decodes at 400 beside a chunk of 150 new tokens on no prefix.

    decode: the batch axis over 2, 3 and 12 (the mixed step's decode part among them) holds
    its ends, the capture sizes between them with their C + 1 (2, 3, 4, 5, 8, 9) and every
    traced batch (7 values, within the cap of 12); a batch's contexts are those of the steps
    between its neighbours, so 2 gets 400, 3 gets 600, 12 gets 6000, and 4, 5, 8, 9 none.
    prefill: one batch (1); N over 100, 150 (the mixed step's part) and 200: no capture size
    within them, every value kept; prefix depths 0 and 2 blocks of 16 tokens, crossed.
    mixed: one decode batch (2 at 400), one prefill batch (1), the step's tokens T = 152, so
    N = T - 2 = 150, on no prefix."""
    steps = [
        decode_step(3, 600),
        decode_step(12, 6000),
        prefill_step(1, 100, 0),
        prefill_step(1, 200, 32),
        Step(0, 0, 0.01, {}, 2, 400, 1, 150, 0),
    ]
    points = trace_grid(shapes(steps), GRAPHS, LIMITS)
    assert points == [
        *(PrefillPoint(n, p, 1) for n in (100, 150, 200) for p in (0, 32)),
        DecodePoint(400, 2),
        DecodePoint(600, 3),
        DecodePoint(6000, 12),
        MixedPoint(DecodePoint(400, 2), PrefillPoint(150, 0, 1)),
    ]


def test_the_axes_hold_the_graph_boundaries_and_the_ends_of_a_large_trace():
    steps = traced_steps()
    points = trace_grid(shapes(steps), GRAPHS, LIMITS)
    batches = sorted({p.batch_size for p in points if isinstance(p, DecodePoint)})
    assert {8, 9, 16, 17} <= set(batches) and batches[0] == 3 and batches[-1] == 30  # boundaries, ends
    assert len(batches) < 28
    assert all(isinstance(p, (DecodePoint, PrefillPoint, MixedPoint)) for p in points)
    assert any(isinstance(p, MixedPoint) for p in points)  # over the two mixed steps


def test_points_stay_within_the_engines_limits():
    found = shapes([decode_step(4, 4 * 4090), decode_step(4, 4 * 100), prefill_step(1, 100, 4000)])
    decode = decode_points(found, GRAPHS, LIMITS, TRACE_CAPS)
    assert max(p.total_kv_read_tokens for p in decode) == deepest_kv(4, LIMITS) == 4 * (4096 - 3 - 1 - 4)
    prefill = prefill_points(found.prefill, GRAPHS, LIMITS, TRACE_CAPS)
    unit = LIMITS.prefix_unit
    # a 4000-token prefix and 100 new tokens do not fit max_model_len with the sweep's margin:
    # the deepest whole-block prefix that does stands in (4096 - 4 - 1 - 100 = 3991 -> 3984)
    assert max(p.total_kv_read_tokens for p in prefill) == 3984
    assert all(p.total_kv_read_tokens % unit == 0 and p.tokens_spanned(unit) <= 4096 - 4 for p in prefill)


def test_steps_that_continue_their_prompts_get_continuation_points_where_the_engine_measures_them():
    # one new request's chunk (no prefix) and two later chunks of prompts (on 3 and 9 blocks)
    new = prefill_step(1, 200, 0)
    going_on = [dataclasses.replace(prefill_step(1, 256, u * 16), continuations=1) for u in (3, 9)]
    both = dataclasses.replace(prefill_step(2, 300, 160), continuations=1)  # one of two continues: new
    found = shapes([new, *going_on, both])
    assert found.continued == {(1, 256, 48): 1, (1, 256, 144): 1} and (2, 300, 160) in found.prefill
    trace = found
    able = dataclasses.replace(LIMITS, continuations=True)
    continued = [p for p in trace_grid(trace, GRAPHS, able) if p.continuation]
    assert {(p.batch_size, p.total_prefill_tokens, p.total_kv_read_tokens) for p in continued} == {
        (1, 256, 48),
        (1, 256, 144),
    }
    # a mixed step whose chunk continues gets a continuation mixed point; its lead step must fit
    # the budget (a prefix block per request), so a batch that could not lead is left out
    mixed = dataclasses.replace(mixed_step(4, 400, 1, 300, 64), continuations=1)
    laid = mixed_points(shapes([mixed]).mixed_continued, GRAPHS, able, TRACE_CAPS, continuation=True)
    assert {(p.prefill.total_prefill_tokens, p.prefill.total_kv_read_tokens, p.prefill.continuation) for p in laid} == {
        (300, 64, True)
    }
    assert [p for p in trace_grid(shapes([mixed]), GRAPHS, able) if isinstance(p, MixedPoint)] == laid
    narrow = dataclasses.replace(GRAPHS, max_num_batched_tokens=47)  # 3 requests x 16 > 47
    assert not prefill_points(Counter({(3, 300, 96): 1}), narrow, able, TRACE_CAPS, continuation=True)
    # where the engine cannot (more than one rank, or no chunked prefill) they join the new ones
    plain = trace_grid(trace, GRAPHS, LIMITS)
    assert not any(isinstance(p, PrefillPoint) and p.continuation for p in plain)
    assert {(p.total_prefill_tokens, p.total_kv_read_tokens) for p in plain} >= {(256, 48), (256, 144)}


def mixed_step(b: int, k: int, bp: int, n: int, p: int) -> Step:
    return Step(0, 0, 0.01, {}, b, k, bp, n, p)


# two mixed steps: a budget-filling chunk (4 + 505 of 512 tokens) on no prefix, and a smaller
# one on a prefix of 10 blocks beside a wider, deeper decode part
MIXED_STEPS = [mixed_step(4, 4 * 100, 1, 505, 0), mixed_step(20, 20 * 150, 1, 300, 160)]


def test_mixed_points_span_the_traced_mixed_steps_within_the_budget():
    """Written from the rule (docs/sweep-reference.md, the grid from a trace), not by the grid's code:
    with the default cap of 2 each axis holds the traced ends: decode batches 4 and 20 (each
    at its own step's K: 400 and 3000), one prefill request, the steps' tokens T = N + decode
    batch 320 and 509, prefixes of 0 and 10 blocks (160 tokens), crossed: each point's N is
    its T less its decode batch (316 and 505 beside 4 decodes, 300 and 489 beside 20)."""
    points = mixed_points(shapes(MIXED_STEPS).mixed, GRAPHS, LIMITS, TRACE_CAPS)
    laid = {
        (
            p.decode.batch_size,
            p.decode.total_kv_read_tokens,
            p.prefill.batch_size,
            p.prefill.total_prefill_tokens,
            p.prefill.total_kv_read_tokens,
        )
        for p in points
    }
    assert laid == {
        (4, 400, 1, 316, 0),
        (4, 400, 1, 316, 160),
        (4, 400, 1, 505, 0),
        (4, 400, 1, 505, 160),
        (20, 3000, 1, 300, 0),
        (20, 3000, 1, 300, 160),
        (20, 3000, 1, 489, 0),
        (20, 3000, 1, 489, 160),
    }
    assert len(points) == len(laid)  # each once
    for s in MIXED_STEPS:  # every traced mixed step is a laid point
        assert (
            s.decode_requests,
            s.decode_kv_tokens,
            s.prefill_requests,
            s.prefill_new_tokens,
            s.prefill_prefix_tokens,
        ) in laid
    # a mixed step's parts still feed the decode and prefill axes (the composed prediction reads them)
    found = shapes(MIXED_STEPS)
    # (the capture sizes between 4 and 20 are on the batch axis, but no step reads their curves)
    assert {p.batch_size for p in decode_points(found, GRAPHS, LIMITS, TRACE_CAPS)} == {4, 20}
    assert {p.total_prefill_tokens for p in prefill_points(found.prefill, GRAPHS, LIMITS, TRACE_CAPS)} == {300, 505}
    assert [p for p in trace_grid(shapes(MIXED_STEPS), GRAPHS, LIMITS) if isinstance(p, MixedPoint)] == points


def test_a_cap_spreads_the_mixed_axes_over_the_traced_steps_within_the_engines_limits():
    """Three steps and a cap of 3: every traced value on each axis (T: 202, 320, 509, each
    less each decode batch); a decode part as deep as
    max_model_len allows over a mixed point's 9 decode steps (a traced context of 4090 tokens
    per request comes down to 4096 - 4 - 9 - 1 = 4082), and a prefix too deep beside its new
    tokens gives way to the deepest whole-block prefix that fits (4096 - 4 - 1 - 200 = 3891 ->
    3888 = 243 blocks)."""
    steps = [*MIXED_STEPS, mixed_step(2, 2 * 4090, 1, 200, 3984)]
    points = mixed_points(shapes(steps).mixed, GRAPHS, LIMITS, {**TRACE_CAPS, "mixed": 3})
    assert sorted({p.decode.batch_size for p in points}) == [2, 4, 20]
    assert sorted({p.prefill.total_prefill_tokens for p in points}) == [182, 198, 200, 300, 316, 318, 489, 505, 507]
    assert max(p.decode.total_kv_read_tokens for p in points if p.decode.batch_size == 2) == 2 * 4082
    assert sorted({p.prefill.total_kv_read_tokens for p in points if p.prefill.total_prefill_tokens == 200}) == [
        0,
        160,
        3888,
    ]
    for p in points:
        assert p.decode.batch_size + p.prefill.total_prefill_tokens <= 512
        assert -(-p.decode.total_kv_read_tokens // p.decode.batch_size) + 1 + 9 <= 4096 - 4
        assert p.prefill.total_kv_read_tokens % 16 == 0
        assert p.prefill.total_kv_read_tokens + p.prefill.total_prefill_tokens + 1 <= 4096 - 4


def test_decode_parts_beside_a_wider_prefill_part_give_way_to_what_max_num_seqs_leaves():
    """max_num_seqs 8: beside three prefill requests at most 5 decodes fit, so the traced
    decode batches 1 and 7 are laid as 1 and 5 there (7's context per request kept: 700 ->
    500), and a step of 3 decodes beside 2 chunks is enclosed by the table over the grid."""
    graphs = dataclasses.replace(GRAPHS, max_num_seqs=8)
    steps = [mixed_step(1, 100, 1, 505, 0), mixed_step(7, 700, 1, 505, 0), mixed_step(1, 100, 3, 300, 96)]
    steps.append(mixed_step(3, 300, 2, 509, 32))
    points = mixed_points(shapes(steps).mixed, graphs, LIMITS, TRACE_CAPS)
    beside = {
        pb: {(p.decode.batch_size, p.decode.total_kv_read_tokens) for p in points if p.prefill.batch_size == pb}
        for pb in (1, 3)
    }
    assert beside == {1: {(1, 100), (7, 700)}, 3: {(1, 100), (5, 500)}}
    assert all(p.decode.batch_size + p.prefill.batch_size <= 8 for p in points)
    got = table_over(points).mixed_step(3, 300, 2, 509, 32)
    assert got.inside and got.how == "measured"


@pytest.mark.parametrize("gate", [{"attention_only": False}, {"attention_only": False, "state_mode": "inplace"}])
def test_no_mixed_point_is_laid_where_the_engine_cannot_measure_them(gate):
    limits = dataclasses.replace(LIMITS, **gate)
    trace = shapes(MIXED_STEPS)
    assert mixed_points(shapes(MIXED_STEPS).mixed, GRAPHS, limits, TRACE_CAPS) == []
    assert trace_grid(trace, GRAPHS, limits) == [
        p for p in trace_grid(trace, GRAPHS, LIMITS) if not isinstance(p, MixedPoint)
    ]


def test_caps_are_checked_by_name():
    assert caps_of({"kv_ladder": 2}) == {**TRACE_CAPS, "kv_ladder": 2}
    for bad in ({"ladder": 2}, {"kv_ladder": 0}, [1]):
        with pytest.raises(SettingsError, match="positive integers among decode_batches"):
            caps_of(bad)


def matching_trace(folder, model_dir, **resolved) -> None:
    """A trace of the test scheduler's engine: what a made header can know of it (the model,
    the layout); fields the header leaves out are not compared (the loop among them: vLLM
    resolves it per platform, and a scheduler stepped by hand runs none)."""
    head = header()
    for field in ("build", "hardware", "torch", "engine_loop"):
        del head[field]
    head.update(model=str(model_dir), engine={"given": ["--model", str(model_dir)], "resolved": resolved})
    steps = [step(0, None, (2, 60))]
    steps += [step(i, 5.0, (b, b * c)) for i, (b, c) in enumerate([(1, 30), (2, 90), (3, 150), (3, 40)], start=1)]
    steps += [step(i, 7.0, (0, 0), (1, n, p)) for i, (n, p) in enumerate([(32, 0), (100, 48), (64, 16)], start=5)]
    steps.append(step(8, 8.0, (2, 120), (1, 32, 0)))  # a mixed step
    write_trace(folder, steps, head=head)


SMALL = {"decode_batches": 3, "kv_ladder": 2, "prefill_batches": 1, "prefill_tokens": 2, "prefix_depths": 2}


def test_a_grid_from_a_trace_sweeps_on_a_real_scheduler_and_its_table_covers_the_trace(tmp_path, monkeypatch):
    from vllm.kvwarm.record.validate.validation import validate
    from vllm.kvwarm.scheduler import KvWarmScheduler
    from vllm.kvwarm.sweep.points import parse_points
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    trace, out = tmp_path / "trace", tmp_path / "out"
    matching_trace(trace, tmp_path / "tiny-llama")
    # the first step (untimed: no window) ended 0.01 s in; leaving it out changes no point
    spec = {"grid_from": str(trace), "grid_caps": SMALL, "grid_skip_seconds": 0.015, "out": str(out)}
    scheduler = make_scheduler(
        tmp_path, num_blocks=256, scheduler_cls=KvWarmScheduler, additional_config={"kvwarm_sweep": spec}
    )
    for _ in range(5000):
        if scheduler.kvwarm_sweep.done:
            break
        step_scheduler(scheduler)
    artifact = json.loads((out / "sweep.json").read_text())
    assert artifact["status"] == "complete" and not artifact["skipped_points"]
    grid = parse_points(json.loads((out / "grid.json").read_text()), "grid", 1024, 3)
    assert len(artifact["results"]) == len(grid) == artifact["kvwarm"]["grid"]["points"]
    assert artifact["kvwarm"]["grid"]["trace"] == str(trace) and artifact["kvwarm"]["grid"]["skip_seconds"] == 0.015
    assert sorted({p.batch_size for p in grid if isinstance(p, DecodePoint)}) == [1, 2, 3]
    tokens = sorted({p.total_prefill_tokens for p in grid if isinstance(p, PrefillPoint)})
    assert (tokens[0], tokens[-1]) == (32, 100)  # the ends (with any capture size between)
    assert {p.total_kv_read_tokens for p in grid if isinstance(p, PrefillPoint)} == {0, 48}
    assert [p for p in grid if isinstance(p, MixedPoint)] == [MixedPoint(DecodePoint(120, 2), PrefillPoint(32, 0, 1))]
    assert json.loads((out / "grid.json").read_text())["schema_version"] == 2
    result = validate(str(out), str(trace))
    summary = result.summary()
    assert summary["coverage"] == 100.0 and summary["steps"] == 8 and summary["mixed_predictor"] == "measured"
    assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_a_trace_of_another_engine_is_refused_once_the_engine_resolved_its_arguments(tmp_path, monkeypatch):
    from vllm.kvwarm.scheduler import KvWarmScheduler

    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    trace, out = tmp_path / "trace", tmp_path / "out"
    matching_trace(trace, tmp_path / "tiny-llama", dtype="int8", max_num_batched_tokens=2048)
    spec = {"grid_from": str(trace), "out": str(out)}
    with pytest.raises(TraceError, match="differ in what changes a step's time") as err:
        make_scheduler(tmp_path, scheduler_cls=KvWarmScheduler, additional_config={"kvwarm_sweep": spec})
    assert "resolved.dtype (trace 'int8', engine 'float32')" in str(err.value)
    assert "resolved.max_num_batched_tokens (trace 2048, engine 256)" in str(err.value)
    artifact = json.loads((out / "sweep.json").read_text())
    assert artifact["status"] == "failed" and "resolved.dtype" in artifact["error"]


def test_a_trace_of_another_model_is_refused_from_the_given_arguments_alone(tmp_path):
    """What the command checks before the engine loads (its run is tested on the CPU engine's
    wheel, whose argument parser runs on a host without a GPU: tests/engine)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.kvwarm.sweep.trace_grid import check_given

    trace = tmp_path / "trace"
    write_trace(trace, [step(0, None, (1, 10)), step(1, 5.0, (1, 11))])  # of /models/tiny-qwen3-moe
    with pytest.raises(TraceError, match="the trace ran another engine") as err:
        check_given(str(trace), EngineArgs(model="/models/other", max_num_batched_tokens=512, tensor_parallel_size=2))
    said = str(err.value)
    assert "model (trace 'tiny-qwen3-moe', given 'other')" in said and "--model /models/tiny-qwen3-moe" in said
    assert "max_num_batched_tokens (trace 256, given 512)" in said and "tensor_parallel_size (trace 1, given 2)" in said
    # a path elsewhere to the same model, and arguments left to their defaults, are no difference
    assert check_given(str(trace), EngineArgs(model="/elsewhere/tiny-qwen3-moe/"))[1].decode


def test_a_skip_that_leaves_no_step_is_refused_on_a_real_scheduler(tmp_path, monkeypatch):
    from vllm.kvwarm.scheduler import KvWarmScheduler

    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    trace, out = tmp_path / "trace", tmp_path / "out"
    matching_trace(trace, tmp_path / "tiny-llama")
    spec = {"grid_from": str(trace), "grid_skip_seconds": 60, "out": str(out)}
    with pytest.raises(TraceError, match=r"leaves none of the 9 steps .* give fewer seconds"):
        make_scheduler(tmp_path, scheduler_cls=KvWarmScheduler, additional_config={"kvwarm_sweep": spec})
    artifact = json.loads((out / "sweep.json").read_text())
    assert artifact["status"] == "failed" and "grid_skip_seconds" in artifact["error"]


def test_skip_seconds_leaves_a_servers_warm_up_out_of_the_grid(tmp_path):
    """--skip-seconds S: the steps that ended within the trace's first S seconds (a fresh
    server's one request of every length) lay no point; checked before the engine loads."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.kvwarm.sweep.trace_grid import check_given

    trace, args = tmp_path / "trace", EngineArgs(model="/models/tiny-qwen3-moe")
    warm_up = [step(n, 5.0, prefill=(1, n + 1, 0)) for n in range(4)]  # ended 0.01-0.04 s in
    served = [step(n, 7.0, prefill=(1, 100, 48)) for n in (4, 5)] + [step(6, 5.0, (2, 120), (1, 32, 64))]
    write_trace(trace, warm_up + served)

    def prefill_tokens(found: Shapes) -> list[int]:
        return sorted(
            {p.total_prefill_tokens for p in trace_grid(found, GRAPHS, LIMITS) if isinstance(p, PrefillPoint)}
        )

    (_, whole), (_, skipped) = check_given(str(trace), args), check_given(str(trace), args, 0.045)
    assert skipped.prefill == {(1, 100, 48): 2, (1, 32, 64): 1} and skipped.decode == {(2, 120): 1}
    assert sum(whole.prefill.values()) == 7  # the warm-up's 4 steps among them
    trace_read, _ = check_given(str(trace), args)
    assert trace_read.steps == [] and trace_read.step_count == 7  # streamed: counted per shape, never held
    assert prefill_tokens(whole)[0] == 1 and prefill_tokens(skipped)[0] == 32
    with pytest.raises(TraceError, match=r"leaves none of the 7 steps .*0\.1 s into it\); give fewer seconds"):
        check_given(str(trace), args, 1.0)
    for bad in (-1.0, float("nan"), True, "5"):
        with pytest.raises(SettingsError, match="give the seconds of the trace to leave out, 0 or more"):
            check_given(str(trace), args, bad)


def test_grid_caps_and_skip_seconds_go_with_grid_from_only():
    from vllm.kvwarm.sweep.command import run

    for given in (["--grid-caps", "{}"], ["--skip-seconds", "5"]):
        with pytest.raises(SystemExit):
            run(["--grid", *given, "--out", "out", "--model", "/models/other"])
