"""The generated grid's mixed points: laid filling the chunk budget at a few decode batches,
each one step the engine runs and each rung within the pool, none (said why) where the engine
cannot measure them, and the points file's schema (2 only with mixed points). Expectations
are worked out by hand from the rule (docs/sweep-reference.md, the generated grid)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_grid import CAPS, GRAPHS, LIMITS, _grid_sweep
from vllm.kvwarm.record.shape import GraphConfig
from vllm.kvwarm.sweep.grid import GridLimits, decode_grid, mixed_grid, mixed_note, points_file
from vllm.kvwarm.sweep.points import DecodePoint, MixedPoint, PrefillPoint, parse_points


def test_the_grid_lays_mixed_points_filling_the_chunk_budget_at_a_few_decode_batches():
    """Written from the rule (docs/sweep-reference.md, the generated grid), not by the grid's code. The
    decode part's batch axis: capture sizes with C + 1 up to 127 (max_num_seqs 128 less the
    prefill request), thinned to 3 without pairs: 1, 127 and the value nearest (in log) to
    sqrt(127) = 11.3: 9 (ln 2.20 against ln 11.3 = 2.42; 16 is ln 2.77). A mixed point's decode
    requests run 2 x (3 + 1) + 1 = 9 steps, so a request's context is at most
    4096 - 4 - 9 - 1 = 4082 tokens; B = 127 is held by the pool instead: 0.8 x 400000 less the
    tails (2 x 127 x 16), the chunk (1921) and a block (16) is 313999 tokens, 2472 per chain,
    less the steps and the admission token: 2462 per request. The chunk is 2048 - B (2047,
    2039, 1921) and a quarter step's, 512 - B (511, 503, 385); the prefix, one chunk in whole 16-token
    blocks (2032, 2032, 1920), leaves every N its whole value (4092 - 1 - 2032 = 2059). The
    shallowest decode part is 3B: its shadows reach the first timed shot after a gap step, so
    they are admitted at one token short of a 3-token context, less the gap's token."""
    points = mixed_grid(GRAPHS, LIMITS)
    laid = {
        (
            p.decode.batch_size,
            p.decode.total_kv_read_tokens,
            p.prefill.total_prefill_tokens,
            p.prefill.total_kv_read_tokens,
        )
        for p in points
    }
    expected = set()
    for b, deepest, chunk, quarter, depth in (
        (1, 4082, 2047, 511, 2032),
        (9, 9 * 4082, 2039, 503, 2032),
        (127, 127 * 2462, 1921, 385, 1920),
    ):
        expected |= {(b, k, n, p) for k in (3 * b, deepest) for n in (chunk, quarter) for p in (0, depth)}
    assert laid == expected and len(points) == 24
    assert all(p.prefill.batch_size == 1 for p in points)
    _assert_within_the_engine(points, GRAPHS, LIMITS)


def _assert_within_the_engine(points: list, graphs: GraphConfig, limits: GridLimits) -> None:
    """Every mixed point one step the engine runs (the budget, max_num_seqs, max_model_len with
    the chains' margin of 4) and each rung (by chain count: the larger part's batch) within 0.8
    of the pool: its chains as deep as its deepest part, beside its largest shot (two blocks of
    tail per decode request, the new tokens and a block per prefill request)."""
    steps = 2 * (limits.steady_steps + 1) + 1
    rungs: dict[int, list] = {}
    for p in points:
        d, f = p.decode, p.prefill
        assert d.batch_size + f.total_prefill_tokens <= graphs.max_num_batched_tokens, p
        assert d.batch_size + f.batch_size <= graphs.max_num_seqs, p
        assert -(-d.total_kv_read_tokens // d.batch_size) + 1 + steps <= limits.max_model_len - 4, p
        prefix = f.total_kv_read_tokens // f.batch_size  # the grid's prefixes split evenly in whole blocks
        assert prefix % limits.prefix_unit == 0, p
        assert prefix + -(-f.total_prefill_tokens // f.batch_size) + 1 <= limits.max_model_len - 4, p
        rungs.setdefault(max(d.batch_size, f.batch_size), []).append(p)
    for chains, rung in rungs.items():
        depth = max(
            max(
                -(-p.decode.total_kv_read_tokens // p.decode.batch_size) + 1 + steps,
                p.prefill.total_kv_read_tokens // p.prefill.batch_size,
            )
            for p in rung
        )
        shot = max(
            2 * p.decode.batch_size * 16 + p.prefill.total_prefill_tokens + 16 * p.prefill.batch_size for p in rung
        )
        assert chains * depth + shot <= 0.8 * limits.kv_cache_tokens, (chains, depth, shot)


def test_a_small_pool_holds_the_mixed_rungs_chains_beside_their_shots():
    """256 blocks of 16 (4096 tokens, 3276 of them the grid's share), max_model_len 1024, a
    budget of 256 and 8 requests, no capture sizes: decode batches 1, 2, 4 and the limit 7,
    thinned to 1, 2 (nearest sqrt(7) = 2.6 in log) and 7. B = 7 is held by the pool:
    3276 - 2 x 7 x 16 - 249 - 16 = 2787 tokens, 398 per chain, 388 per request (K = 2716)."""
    graphs = GraphConfig(capture_sizes=(), max_num_seqs=8, max_num_batched_tokens=256)
    limits = GridLimits(
        max_model_len=1024, steady_steps=3, kv_cache_tokens=4096, num_blocks=256, block_size=16, prefix_unit=16
    )
    points = mixed_grid(graphs, limits)
    deepest = {b: max(p.decode.total_kv_read_tokens for p in points if p.decode.batch_size == b) for b in (1, 2, 7)}
    assert deepest == {1: 1010, 2: 2020, 7: 2716}  # 1024 - 4 - 9 - 1 = 1010 per request where the pool allows
    assert {p.prefill.total_kv_read_tokens for p in points} == {0, 240}  # one chunk (255, 254, 249) in whole blocks
    _assert_within_the_engine(points, graphs, limits)


@pytest.mark.parametrize(
    "gate, said",
    [
        ({"attention_only": False}, "and this sweep measures on fake KV"),
        ({"attention_only": False, "state_mode": "inplace"}, "set DYN_BENCH_KV_WARMUP_STATE=exact or auto"),
    ],
    ids=["recurrent-state-on-fake-kv", "recurrent-state-in-place"],
)
def test_a_grid_lays_no_mixed_point_where_the_engine_cannot_measure_them_and_says_why(gate, said):
    limits = dataclasses.replace(LIMITS, **gate)
    assert mixed_grid(GRAPHS, limits) == [] and said in mixed_note(limits)
    assert mixed_note(LIMITS) is None
    assert decode_grid(GRAPHS, limits) == decode_grid(GRAPHS, LIMITS)  # the other kinds as before


def test_a_grid_on_recurrent_state_lays_mixed_points_in_exact_state_with_room_for_the_catch_ups():
    """Exact state (and copy) hands the state over, so the grid lays mixed points on a model
    with recurrent state. In exact state each decode request's catch-up holds up to a state
    block (here the prefix unit, 16) and a block beside the chains: B = 127 is held by
    0.8 x 400000 less the tails (2 x 127 x 16), the catch-ups (127 x 32), the chunk (1921) and
    a block (16) = 309935 tokens, 2440 per chain, 2430 per request; B = 1 and 9 stay at
    max_model_len's 4082. Copy needs no catch-up: the attention-only grid."""
    exact = dataclasses.replace(LIMITS, attention_only=False, state_mode="exact")
    assert mixed_note(exact) is None
    points = mixed_grid(GRAPHS, exact)
    deepest = {b: max(p.decode.total_kv_read_tokens for p in points if p.decode.batch_size == b) for b in (1, 9, 127)}
    assert deepest == {1: 4082, 9: 9 * 4082, 127: 127 * 2430}
    attention = mixed_grid(GRAPHS, LIMITS)
    assert [p for p in points if p.decode.batch_size < 127] == [p for p in attention if p.decode.batch_size < 127]
    assert mixed_grid(GRAPHS, dataclasses.replace(LIMITS, attention_only=False, state_mode="copy")) == attention


def test_the_grids_points_file_is_schema_1_without_mixed_points_and_2_with_them():
    plain = [PrefillPoint(64, 0, 1), DecodePoint(32, 2)]
    assert points_file(plain) == {
        "schema_version": 1,
        "prefill": [{"total_prefill_tokens": 64, "total_kv_read_tokens": 0, "batch_size": 1}],
        "decode": [{"total_kv_read_tokens": 32, "batch_size": 2}],
    }
    mixed = MixedPoint(DecodePoint(200, 2), PrefillPoint(64, 32, 1))
    written = points_file([*plain, mixed])
    assert written["schema_version"] == 2 and written["mixed"] == [
        {
            "decode": {"total_kv_read_tokens": 200, "batch_size": 2},
            "prefill": {"total_prefill_tokens": 64, "total_kv_read_tokens": 32, "batch_size": 1},
        }
    ]
    assert parse_points(written, "grid.json", 1024, 3) == [*plain, mixed]


def test_a_grid_on_a_model_with_recurrent_state_on_fake_kv_lays_no_mixed_point_and_says_why(tmp_path, monkeypatch):
    """A hybrid layout (an align-mode state group beside attention) with the warm-up off: no
    state is handed over on fake KV, so the grid lays no mixed point, its points file stays
    schema 1, and the record and the log say why."""
    from vllm.kvwarm.sweep import writer

    logged: list[str] = []
    monkeypatch.setattr(writer.logger, "info", lambda fmt, *args: logged.append(fmt % args))
    scheduler, out = _grid_sweep(
        tmp_path, monkeypatch, CAPS, num_blocks=256, block_size=64, state_block_size=64, hash_block_size=16
    )
    written = json.loads((out / "grid.json").read_text())
    assert written["schema_version"] == 1 and "mixed" not in written and written["decode"]
    note = scheduler.kvwarm_run.writer.meta.grid["mixed_note"]  # the artifact's kvwarm.grid from its next write
    assert note == (
        "this model keeps recurrent state, which a mixed point's decode part takes over on real KV only (exact "
        "state or copy), and this sweep measures on fake KV"
    )
    assert any("generated a grid" in line and line.endswith(f"; no mixed points: {note}") for line in logged)


def test_the_grids_mixed_parts_on_a_chunks_prefix_are_continuations_where_the_engine_measures_them():
    """A served step's chunk on a chunk's prefix is a prompt's later chunk: a continuation."""
    plain = mixed_grid(GRAPHS, LIMITS)
    able = mixed_grid(GRAPHS, dataclasses.replace(LIMITS, continuations=True))
    assert any(p.prefill.total_kv_read_tokens for p in plain)
    assert not any(p.prefill.continuation for p in plain)
    assert [(p.decode, p.prefill.total_prefill_tokens, p.prefill.total_kv_read_tokens) for p in able] == [
        (p.decode, p.prefill.total_prefill_tokens, p.prefill.total_kv_read_tokens) for p in plain
    ]
    assert all(p.prefill.continuation == (p.prefill.total_kv_read_tokens > 0) for p in able)
