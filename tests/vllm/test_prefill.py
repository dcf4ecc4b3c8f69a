"""Prefill points stepped against a real Scheduler (sync, and async in the order of vLLM's
batch-queue loop), the model runner's part played by the test: shots of exactly B new requests
on real or fake prefixes, their time, their checks and skips, prefill and decode points in one
sweep, and the limits checked before anything runs."""

from __future__ import annotations

import itertools
import re

import pytest
from kvwarm_testing.real_kv import EngineLoop, ManualClock, in_use, make_scheduler, runner_output, step_scheduler
from vllm.kvwarm.scheduler import KvWarmAsyncScheduler, KvWarmScheduler
from vllm.kvwarm.sweep import prefill as prefill_module
from vllm.kvwarm.sweep.controller import Sweep
from vllm.kvwarm.sweep.limits import check_points
from vllm.kvwarm.sweep.plan import SweepConfig
from vllm.kvwarm.sweep.points import DecodePoint, PointsFileError, PrefillPoint

STEPS = 3
FORWARD_PER_TOKEN = 1e-3  # the played model runner's forward: this long per token scheduled


@pytest.fixture(autouse=True)
def _hashing():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def _tokens(i: int, depth: int) -> list[int]:
    return [(7 * i + 3 * t) % 200 + 2 for t in range(depth)]


def _sweep(points, clock=None, exchange=None, **config) -> Sweep:
    config = SweepConfig(**{"steady_steps": STEPS, "max_model_len": 1024, **config})
    return Sweep(
        points,
        _tokens if config.real else None,
        config,
        clock=clock or itertools.count().__next__,
        progress=lambda _: None,
        exchange=exchange,
        tail_tokens=[(11 * t) % 190 + 5 for t in range(500)],
        vocab_size=256,
    )


def _run(scheduler, sweep, limit: int = 600, loop: EngineLoop | None = None) -> list:
    """Step to the end (one step at a time, or through `loop`); returns every step's
    SchedulerOutput."""
    scheduler.kvwarm_sweep = sweep
    loop = loop or EngineLoop(scheduler, batch_queue=False)
    for _ in range(limit):
        if not loop.busy():
            break
        loop.step()
    assert sweep.done
    return loop.outputs


def _shots(outputs) -> list[list]:
    """The NewRequestData of every step that scheduled prefill-point requests."""
    return [
        [r for r in o.scheduled_new_reqs]
        for o in outputs
        if any(r.req_id.startswith(prefill_module.PREFILL_PREFIX) for r in o.scheduled_new_reqs)
    ]


@pytest.mark.parametrize(
    "cls, batch_queue", [(KvWarmScheduler, False), (KvWarmAsyncScheduler, True)], ids=["sync", "async-batch-queue"]
)
def test_prefill_points_run_as_shots_of_b_new_requests_on_real_prefixes(tmp_path, cls, batch_queue):
    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=cls)
    points = [PrefillPoint(96, 128, 2), PrefillPoint(40, 0, 2), PrefillPoint(30, 48, 1)]
    clock = ManualClock()  # moved only by the played model runner: FORWARD_PER_TOKEN per token
    loop = EngineLoop(
        scheduler, batch_queue, clock, lambda output: FORWARD_PER_TOKEN * output.total_num_scheduled_tokens
    )
    sweep = _sweep(points, clock)
    outputs = _run(scheduler, sweep, loop=loop)
    assert sweep.reset_prefix_cache_ok and in_use(scheduler.kv_cache_manager.block_pool) == {}
    rows = [
        (
            r.point_type,
            r.total_prefill_tokens,
            r.total_kv_read_tokens,
            r.batch_size,
            r.kv_seed_regime,
            r.sample_reasons,
            len(r.samples),
        )
        for r in sweep.rows
    ]
    assert rows == [
        ("prefill", 96, 128, 2, "real_prefix", ["prefill_real_seed"], STEPS),
        ("prefill", 40, 0, 2, "not_applicable", [], STEPS),
        ("prefill", 30, 48, 1, "real_prefix", ["prefill_real_seed"], STEPS),
    ]
    # a warm shot and STEPS measured shots per point, each exactly the point's B new requests,
    # N new tokens and a hit of P (vLLM's own count of the tokens it found computed)
    shots = _shots(outputs)
    expected = [(2, 96, 128)] * (1 + STEPS) + [(2, 40, 0)] * (1 + STEPS) + [(1, 30, 48)] * (1 + STEPS)
    assert [
        (len(s), sum(len(r.prompt_token_ids) - r.num_computed_tokens for r in s), sum(r.num_computed_tokens for r in s))
        for s in shots
    ] == expected
    # every shot's tails are its own: no two shots' requests share a prompt
    prompts = [tuple(r.prompt_token_ids) for s in shots for r in s]
    assert len(set(prompts)) == len(prompts)
    # A shot's time runs from the end of the schedule() that scheduled it to its output: its own
    # step's forward, N tokens' worth, whichever loop (the batch queue's next step is empty).
    for row in sweep.rows:
        forward = FORWARD_PER_TOKEN * row.total_prefill_tokens
        assert row.samples == pytest.approx([forward] * STEPS)
        assert row.median_seconds == row.phases["forward"] == pytest.approx(forward)


def test_prefill_points_run_before_decode_points_in_one_sweep(tmp_path):
    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=KvWarmScheduler)
    sweep = _sweep([DecodePoint(200, 2), PrefillPoint(64, 64, 2)])
    _run(scheduler, sweep)
    assert [(r.point_type, r.kv_seed_regime) for r in sweep.rows] == [("prefill", "real_prefix"), ("decode", "real_kv")]
    assert sweep.reset_prefix_cache_ok and in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_warm_up_off_measures_prefill_on_fake_prefixes_registered_and_never_computed(tmp_path):
    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=KvWarmAsyncScheduler)
    sweep = _sweep([PrefillPoint(64, 96, 2), PrefillPoint(16, 0, 1)], real=False, fake_regime="legacy")
    outputs = _run(scheduler, sweep)
    assert not sweep.stages  # no chains
    assert [(r.kv_seed_regime, r.sample_reasons) for r in sweep.rows] == [
        ("fake_prefix", ["prefill_fake_prefix"]),
        ("not_applicable", []),
    ]
    assert [sum(r.num_computed_tokens for r in s) for s in _shots(outputs)][: 1 + STEPS] == [96] * (1 + STEPS)
    assert sweep.reset_prefix_cache_ok and in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_without_held_out_text_a_shots_new_tokens_are_a_salted_sequence_not_one_token(tmp_path):
    """Fake KV (warm-up off) has no dataset: each request's new tokens are a salted sequence
    of its own, as fake KV's prompts are, so MoE routing sees varied tokens (they were one
    token repeated)."""
    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=KvWarmScheduler)
    config = SweepConfig(steady_steps=STEPS, max_model_len=1024, real=False, fake_regime="legacy")
    sweep = Sweep(
        [PrefillPoint(96, 0, 2)], None, config, clock=itertools.count().__next__, progress=print, vocab_size=256
    )
    tails = [r.prompt_token_ids for shot in _shots(_run(scheduler, sweep)) for r in shot]
    assert len(tails) == 2 * (1 + STEPS) and all(len(t) == 48 for t in tails)
    for tail in tails:  # past its two lead tokens, no token repeats within a vocabulary's length
        assert len(set(tail[2:])) == len(tail) - 2, tail
    assert len({tuple(t[2:]) for t in tails}) == len(tails)  # every request's tokens its own
    assert [r.kv_seed_regime for r in sweep.rows] == ["not_applicable"]


def test_a_prefix_that_stays_uncached_rebuilds_the_chains_once_then_skips(tmp_path, monkeypatch):
    probes = []
    monkeypatch.setattr(prefill_module, "cached_tokens", lambda kvm, request: probes.append(request) or 0)
    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=KvWarmScheduler)
    sweep = _sweep([PrefillPoint(64, 64, 2), PrefillPoint(20, 0, 2)])
    _run(scheduler, sweep)
    first, second = sweep.rows
    assert first.kv_seed_regime == "skip:real_seed_cache_validation_failed" and "[0, 0]" in first.detail
    assert second.kv_seed_regime == "not_applicable"
    assert len(sweep.stages) == 2  # the chains were built, then built again
    assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_a_shot_the_engine_chunks_is_skipped_as_a_prefill_tokens_mismatch(tmp_path):
    """Limits are checked before the sweep; here the threshold is lowered after that, so the
    scheduler splits the requests' prompts and the shot's check names it."""
    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=KvWarmScheduler)
    sweep = _sweep([PrefillPoint(96, 0, 2)])
    scheduler.scheduler_config.long_prefill_token_threshold = 16
    _run(scheduler, sweep)
    (row,) = sweep.rows
    assert row.kv_seed_regime == "skip:measured_prefill_tokens_mismatch"
    assert "computed 32 new token(s), the point 96" in row.detail
    assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_a_shot_whose_requests_do_not_fit_the_pool_is_skipped_by_name(tmp_path):
    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=KvWarmScheduler)
    sweep = _sweep([PrefillPoint(64, 0, 2)])
    pool = scheduler.kv_cache_manager.block_pool
    taken = pool.get_new_blocks(pool.get_num_free_blocks() - 2)
    scheduler.kvwarm_sweep = sweep
    for _ in range(50):
        if sweep.rows:
            break
        step_scheduler(scheduler)
    (row,) = sweep.rows
    assert row.kv_seed_regime == "skip:prefill_injection_failed" and "pool_exhausted" in row.detail
    pool.free_blocks(taken)
    _run(scheduler, sweep)
    assert in_use(pool) == {}


def test_each_row_names_what_its_samples_are(tmp_path):
    """A prefill row's samples are its shots' forward phases, a decode row's whole steps: the
    row says which (its samples keep the artifact's key, steady_seconds)."""
    from vllm.kvwarm.record.artifact import KvwarmMeta, build_artifact
    from vllm.kvwarm.record.schema import validate

    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=KvWarmScheduler)
    sweep = _sweep([DecodePoint(200, 2), PrefillPoint(64, 64, 2)])
    _run(scheduler, sweep)
    assert [(r.point_type, r.sample_kind) for r in sweep.rows] == [("prefill", "shot_forward"), ("decode", "step")]
    artifact = build_artifact(sweep.rows, KvwarmMeta(), {"points": "p.json"}, "complete")
    validate(artifact)
    assert [(r["sample_kind"], len(r["steady_seconds"])) for r in artifact["results"]] == [
        ("shot_forward", STEPS),
        ("step", STEPS),
    ]


def test_a_timed_shot_without_its_span_is_a_bug_not_a_skipped_point(tmp_path, monkeypatch):
    """The adapter's StepTimer times every step it saw scheduled; a timed shot whose step has
    no span means the sweep is driven wrong: it raises, naming that."""
    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=KvWarmScheduler)
    sweep = _sweep([PrefillPoint(64, 0, 2)])
    monkeypatch.setattr(sweep.timer, "update_done", lambda output, at: None)
    with pytest.raises(RuntimeError, match="a timed prefill shot's step came without its span"):
        _run(scheduler, sweep)
    assert sweep.rows == []


def _hybrid_scheduler(tmp_path):
    """Attention and align-mode state blocks of 64 tokens, prefix-match unit 16."""
    return make_scheduler(
        tmp_path, num_blocks=256, scheduler_cls=KvWarmScheduler, block_size=64, state_block_size=64, hash_block_size=16
    )


def test_a_hybrid_layouts_prefixes_are_whole_state_blocks_hit_with_their_state(tmp_path):
    """A prefix is a whole number of state blocks (a state is cached only at its
    boundaries), and the hit covers it, state included. 16 new tokens per request: no
    boundary where vLLM stops a hybrid prefill lies inside them."""
    scheduler = _hybrid_scheduler(tmp_path)
    sweep = _sweep([PrefillPoint(32, 256, 2)], state_mode="copy")
    outputs = _run(scheduler, sweep)
    assert [r.kv_seed_regime for r in sweep.rows] == ["real_prefix"], [r.detail for r in sweep.rows]
    assert [sorted(r.num_computed_tokens for r in s) for s in _shots(outputs)] == [[128, 128]] * (1 + STEPS)
    with pytest.raises(PointsFileError, match="whole number of 64-token blocks"):
        check_points([PrefillPoint(40, 160, 2)], scheduler.vllm_config, scheduler.kv_cache_manager, "points.json")


def test_a_hybrid_prefill_the_engine_stops_at_its_partial_tail_checkpoint_is_skipped_and_named(tmp_path):
    """Where vLLM caches a hybrid prompt's state at its last prefix-match boundary (partial
    hash hits: a hash block smaller than the state block), it stops the prefill there, so
    20 new tokens per request after 128 run as 16 + 4 over two steps: no one-step point.
    Where it does not, the point runs as one step."""
    scheduler = _hybrid_scheduler(tmp_path)
    sweep = _sweep([PrefillPoint(40, 256, 2)], state_mode="copy")
    _run(scheduler, sweep)
    (row,) = sweep.rows
    if getattr(scheduler, "mamba_partial_cache_hit", False):
        assert row.kv_seed_regime == "skip:measured_prefill_tokens_mismatch"
        assert "computed 32 new token(s), the point 40" in row.detail
    else:
        assert row.kv_seed_regime == "real_prefix", row.detail


@pytest.mark.parametrize(
    "point, message",
    [
        (PrefillPoint(300, 0, 2), "300 new tokens exceed max_num_batched_tokens 256"),
        (PrefillPoint(64, 40, 2), "P must be a whole number of 16-token blocks, at least one per request (use 32"),
        (PrefillPoint(64, 16, 2), "at least one per request (use 32)"),
        (PrefillPoint(200, 2016, 2), "do not fit max_model_len 1024"),
        (PrefillPoint(200, 1600, 2), "need"),
        (PrefillPoint(16, 0, 9), "exceed max_num_seqs 8"),
    ],
)
def test_a_point_the_engine_cannot_run_as_one_step_is_refused_before_the_sweep(tmp_path, point, message):
    scheduler = make_scheduler(tmp_path, num_blocks=64, scheduler_cls=KvWarmScheduler)
    with pytest.raises(PointsFileError, match=re.escape(message)) as err:
        check_points([point], scheduler.vllm_config, scheduler.kv_cache_manager, "points.json")
    assert "points.json" in str(err.value)


def test_a_threshold_below_a_request_is_refused(tmp_path):
    scheduler = make_scheduler(tmp_path, num_blocks=64, scheduler_cls=KvWarmScheduler)
    scheduler.scheduler_config.long_prefill_token_threshold = 16
    with pytest.raises(PointsFileError, match="exceeds long_prefill_token_threshold 16"):
        check_points([PrefillPoint(64, 0, 2)], scheduler.vllm_config, scheduler.kv_cache_manager, "points.json")


def test_a_point_is_checked_beside_its_rungs_deepest_chains_whatever_the_files_order(tmp_path):
    """B = 1 on 63 free blocks of 16 tokens: the deep point alone needs 50 chain blocks and
    1 for its shot, the shallow one 1 and 16; beside the rung's chains (as deep as its deepest
    prefix, 800 tokens) the shallow shot needs 50 + 16 = 66. Listed first it passed, checked
    against chains of its own depth, and failed at its shot."""
    scheduler = make_scheduler(tmp_path, num_blocks=64, scheduler_cls=KvWarmScheduler)
    shallow, deep = PrefillPoint(256, 16, 1), PrefillPoint(16, 800, 1)
    for alone in (shallow, deep):
        check_points([alone], scheduler.vllm_config, scheduler.kv_cache_manager, "points.json")
    for order in ([shallow, deep], [deep, shallow]):
        with pytest.raises(PointsFileError, match=r"N=256 P=16 B=1: its rung's chains \(1 of 800 tokens.* need 66"):
            check_points(order, scheduler.vllm_config, scheduler.kv_cache_manager, "points.json")


def test_a_hybrid_hit_counts_the_boundary_state_block_it_takes(tmp_path):
    """A P > 0 hit on a hybrid layout takes the state block cached at its boundary (free
    where the chain has moved on) besides its running block, as a catch-up's does. Blocks of
    64: the chain holds 2 attention blocks and 1 state block, the shot 1 attention block and
    2 state blocks: 6, one more than the 5 free."""
    scheduler = make_scheduler(
        tmp_path, num_blocks=6, scheduler_cls=KvWarmScheduler, block_size=64, state_block_size=64, hash_block_size=16
    )
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 5
    with pytest.raises(PointsFileError, match="need 6 KV blocks, the pool has 5 free"):
        check_points([PrefillPoint(32, 128, 1)], scheduler.vllm_config, scheduler.kv_cache_manager, "points.json")
    check_points([PrefillPoint(32, 0, 1)], scheduler.vllm_config, scheduler.kv_cache_manager, "points.json")


def test_a_prefix_without_the_prefix_cache_is_refused_by_name(tmp_path):
    scheduler = make_scheduler(tmp_path, num_blocks=64, scheduler_cls=KvWarmScheduler, enable_prefix_caching=False)
    with pytest.raises(PointsFileError, match=r"P > 0, e.g. N=64 P=64 B=2.*--enable-prefix-caching"):
        check_points(
            [PrefillPoint(64, 0, 2), PrefillPoint(64, 64, 2)],
            scheduler.vllm_config,
            scheduler.kv_cache_manager,
            "points.json",
        )
    check_points([PrefillPoint(64, 0, 2)], scheduler.vllm_config, scheduler.kv_cache_manager, "points.json")


def test_the_export_gives_the_variance_of_the_prompts_the_shots_ran(tmp_path):
    """P = 80 over 3 requests in 16-token blocks runs as prefixes 32, 32, 16 (not P split
    evenly): the exported var_prefill_length is that of the prompt lengths vLLM scheduled."""
    import json
    import statistics

    from vllm.kvwarm.record.artifact import KvwarmMeta, build_artifact, write_artifact
    from vllm.kvwarm.record.export.input import load_sweep
    from vllm.kvwarm.record.export.write import write_dynamo

    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=KvWarmScheduler)
    sweep = _sweep([PrefillPoint(100, 80, 3)])
    shots = _shots(_run(scheduler, sweep))
    (row,) = sweep.rows
    assert row.kv_seed_regime == "real_prefix", row.detail
    ran = {statistics.pvariance([len(r.prompt_token_ids) for r in shot]) for shot in shots}
    assert len(ran) == 1  # every shot the same shape
    write_artifact(tmp_path / "s", build_artifact(sweep.rows, KvwarmMeta(), {"points": "p.json"}, "complete"))
    (path,) = write_dynamo(load_sweep(tmp_path / "s"), tmp_path / "b.json")
    scheduled = json.loads(path.read_text())["results"][0]["fpms"][0]["scheduled_requests"]
    assert scheduled["var_prefill_length"] == pytest.approx(ran.pop())


def test_a_prefill_row_whose_shots_spread_is_stamped_noisy_as_a_decode_row_is(tmp_path):
    """The engine's forward is played here with a clock: every shot's forward reads 1 tick but
    one measured shot's, which reads 11, so the row spreads 10 times its median."""

    ticks = itertools.count()
    slow = {"at": 0}
    clock = lambda: next(ticks) + slow["at"]
    config = SweepConfig(steady_steps=STEPS, max_model_len=1024)
    sweep = Sweep(
        [PrefillPoint(40, 0, 2), PrefillPoint(30, 0, 1)], _tokens, config, clock=clock, progress=lambda _: None
    )
    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=KvWarmScheduler)
    scheduler.kvwarm_sweep = sweep
    shot_steps = 0
    for _ in range(200):
        if not scheduler.has_requests():
            break
        output = scheduler.schedule()
        if any(r.req_id.startswith(prefill_module.PREFILL_PREFIX) for r in output.scheduled_new_reqs):
            shot_steps += 1
            if shot_steps == 3:  # the second measured shot of the first point: a slow forward
                slow["at"] += 10
        ids = list(output.num_scheduled_tokens)  # P = 0 points only: every request samples
        sampled = [[7] for _ in ids]
        scheduler.update_from_output(output, runner_output(ids, sampled))
    noisy, quiet = sweep.rows
    assert noisy.samples == [1, 11, 1] and "kvwarm_noisy" in noisy.sample_reasons
    assert quiet.samples == [1, 1, 1] and "kvwarm_noisy" not in quiet.sample_reasons


def test_a_boundary_state_really_evicted_rebuilds_the_chains_then_the_point_is_measured(tmp_path):
    """A real eviction, not a probe made to miss: on a hybrid layout the state cached at a
    shallow boundary is free once the chain has moved past it, so anything that takes free
    blocks evicts it. Here a server's allocation takes every free block between the two
    points of a rung and gives them back; the shallow point's lookup then misses its state,
    the rung's chains are built again (once), and the point is measured on them."""
    scheduler = _hybrid_scheduler(tmp_path)
    sweep = _sweep([PrefillPoint(16, 256, 1), PrefillPoint(16, 128, 1)], state_mode="copy")  # 16: no stop inside
    pool = scheduler.kv_cache_manager.block_pool
    scheduler.kvwarm_sweep = sweep
    evicted = False
    outputs = []
    for _ in range(600):
        if not scheduler.has_requests():
            break
        if len(sweep.rows) == 1 and not evicted:
            taken = pool.get_new_blocks(pool.get_num_free_blocks())  # evicts what is cached but free
            pool.free_blocks(taken)
            evicted = True
        outputs.append(step_scheduler(scheduler))
    assert evicted and sweep.done
    if sweep.rows[1].kv_seed_regime == "skip:real_seed_cache_validation_failed":
        pytest.skip(  # seen on the older releases of the table; open
            "known gap: on this release the rebuilt chains did not hold the boundary state the shallow point "
            f"needs, so it was skipped ({sweep.rows[1].detail})"
        )
    assert [(r.total_kv_read_tokens, r.kv_seed_regime) for r in sweep.rows] == [
        (256, "real_prefix"),
        (128, "real_prefix"),
    ], [r.detail for r in sweep.rows]
    assert [s["depth"] for s in sweep.stages] == [256, 256]  # built, then built again for the shallow point
    shallow = [s for s in _shots(outputs) if sum(r.num_computed_tokens for r in s) == 128]
    assert len(shallow) == 1 + STEPS  # its warm shot and measured shots, all on the rebuilt chains
    assert sweep.reset_prefix_cache_ok and in_use(pool) == {}
