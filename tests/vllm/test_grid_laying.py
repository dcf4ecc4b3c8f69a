"""Laying a generated grid costs the same per point however large the grid: each point is held
to its rung's deepest prefix and largest shot kept so far (sweep.limits.GridFit, sweep.grid.
lay_mixed), and the points laid are exactly those the quadratic laying (check_points over every
kept point for each new one) laid for the same inputs: tests/fixtures/grid-laying.json holds
that laying's points (its `about` says from which tree). Every cap has a bound, the trace's mixed
cap over its five axes, and one beyond it is refused by name before the model loads."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from kvwarm_testing.real_kv import make_scheduler
from test_grid import _grid_sweep
from vllm.kvwarm.record.shape import GraphConfig
from vllm.kvwarm.record.trace.reader import Step
from vllm.kvwarm.sweep import grid
from vllm.kvwarm.sweep.grid import GridLimits
from vllm.kvwarm.sweep.grid_settings import check_grid
from vllm.kvwarm.sweep.limits import EngineLimits, GridFit
from vllm.kvwarm.sweep.points import MixedPoint, PrefillPoint
from vllm.kvwarm.sweep.settings import SettingsError
from vllm.kvwarm.sweep.trace_grid import TRACE_CAP_BOUNDS, caps_of, shapes, trace_grid

FIXTURE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "grid-laying.json").read_text())


def _key(p) -> list:
    if isinstance(p, MixedPoint):
        return ["mixed", *_key(p.decode)[1:], *_key(p.prefill)[1:]]
    if isinstance(p, PrefillPoint):
        return ["prefill", p.total_prefill_tokens, p.total_kv_read_tokens, p.batch_size, bool(p.continuation)]
    return ["decode", p.total_kv_read_tokens, p.batch_size]


def traced_steps(seed: int = 58, count: int = 6000) -> list[Step]:
    """A served trace's steps as the fixture was laid from: decode, prefill (some continuing
    their prompts) and mixed steps over wide ranges, prefixes deep enough for the pool to drop
    points of a rung once a deeper rung-mate is kept."""
    rng = random.Random(seed)
    steps = []
    for i in range(count):
        r = rng.random()
        d, p = (0, 0), (0, 0, 0)
        if r < 0.5:
            b = rng.randint(1, 48)
            d = (b, b * rng.randint(2, 1800))
        elif r < 0.8:
            b = rng.randint(1, 4)
            p = (b, rng.randint(b, 1500), b * 16 * rng.randint(0, 120))
        else:
            b = rng.randint(1, 24)
            d = (b, b * rng.randint(3, 1500))
            bp = rng.randint(1, 3)
            p = (bp, rng.randint(bp, 900), bp * 16 * rng.randint(0, 30))
        continuing = p[0] if p[0] and rng.random() < 0.2 else 0
        steps.append(Step(0, i, 0.01, {}, *d, *p, continuations=continuing, at=i * 0.01))
    return steps


def test_a_generated_grid_lays_the_points_the_quadratic_laying_laid(tmp_path, monkeypatch):
    """A --grid of large caps in a pool that holds its deeper prefill rungs only in part (the
    quadratic laying dropped 142 of 623 candidates)."""
    recorded = FIXTURE["grid"]
    _, out = _grid_sweep(tmp_path, monkeypatch, recorded["caps"], **recorded["scheduler"])
    assert json.loads((out / "grid.json").read_text()) == recorded["points_file"]


def test_a_trace_grid_lays_the_points_the_quadratic_laying_laid(tmp_path):
    """2,498 candidates over 6,000 traced steps (counted per shape), 1,950 kept in a pool of
    259 free blocks, as the quadratic laying kept them."""
    recorded = FIXTURE["trace"]
    sizes = (1, 2, 4, 8, 16, 32, 64)
    graphs = GraphConfig("FULL_AND_PIECEWISE", "FULL", "PIECEWISE", sizes, sizes, sizes, 64, 2048)
    scheduler = make_scheduler(
        tmp_path, num_blocks=260, max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=64
    )
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert free == recorded["free"]
    limits = GridLimits(4096, 3, free * 16, free, 16, 16, continuations=True)
    laid = trace_grid(shapes(traced_steps()), graphs, limits, recorded["caps"])
    assert [_key(p) for p in laid] == recorded["laid"]
    fit = GridFit(EngineLimits.of(scheduler.vllm_config, scheduler.kv_cache_manager, free), "grid.json")
    kept = [i for i, point in enumerate(laid) if fit.add(point)]
    assert kept == recorded["kept"] and fit.kept == [laid[i] for i in kept]
    assert 0 < len(kept) < len(laid)  # the pool dropped points: the check did something


def test_a_point_is_dropped_where_a_deeper_rung_mate_leaves_its_shot_no_room(tmp_path):
    """47 free blocks of 16 (as test_grid's pool test): B = 1 with a 512-token prefix holds 32
    blocks of chains; a 256-token shot (16 blocks) fits alone but not beside them: laid after
    the deep point it is dropped, laid before it it keeps the deep one out."""
    scheduler = make_scheduler(tmp_path, num_blocks=48, max_model_len=1024)
    limits = EngineLimits.of(scheduler.vllm_config, scheduler.kv_cache_manager)
    assert limits.free == 47
    deep, wide = PrefillPoint(16, 512, 1), PrefillPoint(256, 0, 1)
    first = GridFit(limits, "grid.json")
    assert first.add(deep) and not first.add(wide)
    second = GridFit(limits, "grid.json")
    assert second.add(wide) and not second.add(deep)
    assert second.add(PrefillPoint(16, 256, 1))  # chains of 16 blocks beside the wide shot's 16


@pytest.mark.parametrize("name", sorted(grid.CAP_BOUNDS))
def test_a_grid_cap_beyond_its_bound_is_refused_naming_it_and_the_fix(name):
    bound = grid.CAP_BOUNDS[name]
    assert check_grid({name: bound})[0][name] == bound
    with pytest.raises(SettingsError) as err:
        check_grid({name: bound + 1})
    assert f"{name} {bound + 1} is beyond its bound {bound}" in str(err.value)
    assert f"give {name} {bound} or less" in str(err.value) and "--points" in str(err.value)


@pytest.mark.parametrize("name", sorted(TRACE_CAP_BOUNDS))
def test_a_trace_grid_cap_beyond_its_bound_is_refused_naming_it(name):
    bound = TRACE_CAP_BOUNDS[name]
    assert caps_of({name: bound})[name] == bound
    with pytest.raises(SettingsError, match=f"{name} {bound + 1} is beyond its bound {bound}"):
        caps_of({name: bound + 1})


def test_the_trace_grids_mixed_cap_is_bounded_by_its_product_over_five_axes():
    """ "mixed" caps each of five axes, so 7 would lay up to 16,807 candidates."""
    with pytest.raises(SettingsError) as err:
        caps_of({"mixed": 7})
    assert "up to 7^5 = 16,807 points" in str(err.value) and "give mixed 6 or less" in str(err.value)


def test_a_cap_beyond_its_bound_stops_the_command_before_the_engine_loads(tmp_path, capsys, monkeypatch):
    from vllm.kvwarm.sweep.command import run

    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")  # no dataset: the caps are what is wrong
    out = tmp_path / "out"
    assert run(["--grid", json.dumps({"kv_ladder": 1000}), "--out", str(out), "--model", "/nowhere"]) == 2
    assert "kv_ladder 1000 is beyond its bound 256" in capsys.readouterr().err
    assert json.loads((out / "sweep.json").read_text())["status"] == "failed"
    with pytest.raises(SystemExit):  # argparse's refusal of --grid-caps, before anything loads
        run(["--grid-from", str(tmp_path), "--grid-caps", json.dumps({"mixed": 9}), "--out", str(out)])
    assert "9^5 = 59,049" in capsys.readouterr().err
