"""Recurrent-state hand-off on the real CPU engine: a tiny Qwen3-Next (gated-delta-net
linear attention + full attention + MoE) in align mode. A shadow at the chain's computed
depth decodes the same greedy tokens as a natural request over the same prefix, with the
state handed over by copy and in place; in exact mode at contexts off the boundaries too.
In place asked for by a user is refused, since this build can fork (docs/state-handoff.md);
its machinery stays, the hand-off of a build that cannot.

Runs in its own pytest process (`-m hybrid`): one CPU engine per process.
"""

from __future__ import annotations

import random

import pytest
from vllm.kvwarm.kv.chains import chain_request, is_prefilled, park
from vllm.kvwarm.kv.injector import Admission
from vllm.kvwarm.kv.layout import STATE_ALIGN, group_layouts
from vllm.kvwarm.kv.state_mode import STATE_ENV, decide_state_mode
from vllm.kvwarm.record.vocabulary import STATE_INPLACE_UNFAITHFUL

pytestmark = pytest.mark.hybrid
STEPS = 5


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from kvwarm_testing.engine import Engine, hybrid_kernel_refusal, skip_where_refused
    from kvwarm_testing.tiny_models import make_tiny_qwen3_next
    from vllm import LLM

    model = make_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next"))
    skip_where_refused(hybrid_kernel_refusal(model))
    return Engine(
        LLM(
            model=str(model),
            dtype="bfloat16",
            mamba_ssm_cache_dtype="float32",
            mamba_cache_mode="align",
            seed=0,
            enforce_eager=True,
            max_model_len=2048,
            max_num_batched_tokens=256,
            max_num_seqs=8,
            enable_prefix_caching=True,
            scheduler_cls="vllm.kvwarm.scheduler.KvWarmScheduler",
        )
    )


def test_this_build_gives_exact_state_by_default_lent_by_copy_and_refuses_in_place(hybrid):
    kvm = hybrid.kv_cache_manager
    layouts = group_layouts(kvm)
    assert [g.kind for g in layouts].count(STATE_ALIGN) == 3
    decision = decide_state_mode(kvm, layouts, {})
    assert (decision.mode, decision.lending) == ("exact", "copy")
    refused = decide_state_mode(kvm, layouts, {STATE_ENV: "inplace"})
    assert (refused.mode, refused.reason) == (None, STATE_INPLACE_UNFAITHFUL)


@pytest.mark.parametrize("mode", ["copy", "inplace"])
def test_a_shadow_at_the_chain_depth_decodes_like_a_natural_request(hybrid, mode):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.request import RequestStatus

    scheduler, core, pool = hybrid.scheduler, hybrid.core, hybrid.kv_cache_manager.block_pool
    chain = chain_request(scheduler, f"hybrid-{mode}", random.Random(2).choices(range(3, 400), k=700))
    scheduler.add_request(chain)
    while not is_prefilled(chain):
        core.step()
    park(scheduler, chain)
    depth = chain.num_computed_tokens

    point = scheduler.kvwarm_injector.queue(Admission([chain], [depth], steady_steps=STEPS - 1, state_mode=mode))
    for _ in range(50):
        if point.shadows and point.shadows[0].is_finished():
            break
        core.step()
    assert point.failure is None
    shadow_tokens = list(point.shadows[0].output_token_ids)

    natural = hybrid.llm.generate(
        [TokensPrompt(prompt_token_ids=chain.all_token_ids[: depth + 1], cache_salt=f"natural-{mode}")],
        SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True),
        use_tqdm=False,
    )
    assert shadow_tokens == list(natural[0].outputs[0].token_ids)

    scheduler.finish_requests([chain.request_id], RequestStatus.FINISHED_ABORTED)
    core.step()
    assert not [b for b in pool.blocks if b.ref_cnt and not b.is_null]
    assert pool.reset_prefix_cache()


def test_exact_state_shadows_decode_like_natural_requests_off_the_boundaries(hybrid, capsys):
    from kvwarm_testing.exact_fidelity import check_exact_state, print_report

    print_report(check_exact_state(hybrid, "qwen3-next", vocab=400), capsys)


def counted_sweep(points, chain_tokens, config):
    """The tests' in-process sweep: a counting clock (timings are not what is checked), tail
    tokens drawn once, the tiny hybrid's vocabulary."""
    import itertools

    from vllm.kvwarm.sweep.controller import Sweep

    return Sweep(
        points,
        chain_tokens,
        config,
        clock=itertools.count().__next__,
        progress=lambda _: None,
        tail_tokens=random.Random(9).choices(range(3, 400), k=512),
        vocab_size=400,
    )


def test_prefill_and_decode_points_on_the_hybrid_run_on_real_prefixes_and_real_kv(hybrid):
    """Prefill points' prefixes are whole state blocks (a state is cached only at its
    boundaries), found with their state in vLLM's prefix cache; decode points follow in the
    same sweep, exact state by default."""

    from vllm.kvwarm.kv.prefix import prefix_unit
    from vllm.kvwarm.sweep.plan import SweepConfig
    from vllm.kvwarm.sweep.points import DecodePoint, PrefillPoint

    scheduler, core = hybrid.scheduler, hybrid.core
    kvm = scheduler.kv_cache_manager
    decision = decide_state_mode(kvm, group_layouts(kvm), {})
    unit = prefix_unit(group_layouts(kvm), kvm.block_pool.hash_block_size)
    draws = {}

    def chain_tokens(i: int, depth: int) -> list[int]:
        tokens = draws.setdefault(i, random.Random(i).choices(range(3, 400), k=2048))
        return tokens[:depth]

    # a continuation's lead step computes one state block (the whole step budget here) on a hit
    # one block short; its chunk then runs on the running request's own state
    continued = PrefillPoint(24, 2 * unit, 1, continuation=True)
    points = [PrefillPoint(48, 2 * unit, 2), continued, PrefillPoint(32, 0, 1), DecodePoint(1800, 2)]
    config = SweepConfig(steady_steps=3, max_model_len=2048, state_mode=decision.mode, state_lending=decision.lending)
    sweep = counted_sweep(points, chain_tokens, config)
    scheduler.kvwarm_sweep = sweep
    try:
        for _ in range(2000):
            if sweep.done:
                break
            core.step()
    finally:
        scheduler.kvwarm_sweep = None
    assert [(r.point_type, r.kv_seed_regime) for r in sweep.rows] == [
        ("prefill", "real_prefix"),
        ("prefill", "real_prefix"),
        ("prefill", "not_applicable"),
        ("decode", "real_kv"),
    ], [r.detail for r in sweep.rows]
    assert sweep.rows[1].continuation and sweep.rows[1].split["prefix_tokens"] == [2 * unit]
    assert sweep.reset_prefix_cache_ok


def test_mixed_points_on_the_hybrid_in_exact_state_hold_their_shape_on_real_kv(hybrid):
    """Exact state (the build's default): a mixed point's decode shadows borrow from catch-ups
    parked at their own contexts, as a decode point's do, and every shot's step holds exactly
    the decode part's shadows at one token each and the prefill part's new requests, their new
    tokens and their hit (vLLM's own counts; new tokens within a state block: align mode stops
    a prefill at the last boundary before its prompt's end). The mixed rows carry the exact
    state stamps the decode row of the same model gets, at their own contexts."""

    from vllm.kvwarm.kv.injector import SHADOW_PREFIX
    from vllm.kvwarm.kv.prefix import prefix_unit
    from vllm.kvwarm.sweep.limits import check_points
    from vllm.kvwarm.sweep.plan import SweepConfig
    from vllm.kvwarm.sweep.points import DecodePoint, MixedPoint, PrefillPoint
    from vllm.kvwarm.sweep.prefill import PREFILL_PREFIX

    scheduler, core = hybrid.scheduler, hybrid.core
    kvm = scheduler.kv_cache_manager
    decision = decide_state_mode(kvm, group_layouts(kvm), {})
    assert decision.mode == "exact"
    unit = prefix_unit(group_layouts(kvm), kvm.block_pool.hash_block_size)
    assert unit > 24  # the new tokens below stay within a state block
    draws = {}

    def chain_tokens(i: int, depth: int) -> list[int]:
        tokens = draws.setdefault(i, random.Random(i).choices(range(3, 400), k=2048))
        return tokens[:depth]

    mixed = [
        MixedPoint(DecodePoint(900, 2), PrefillPoint(24, unit, 1)),
        MixedPoint(DecodePoint(301, 2), PrefillPoint(30, 0, 2)),
    ]
    check_points(mixed, scheduler.vllm_config, kvm, "points.json", state_mode=decision.mode)
    config = SweepConfig(steady_steps=3, max_model_len=2048, state_mode=decision.mode, state_lending=decision.lending)
    sweep = counted_sweep([DecodePoint(900, 2), *mixed], chain_tokens, config)
    outputs = []
    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        output = schedule(*args, **kwargs)
        outputs.append(output)
        return output

    scheduler.schedule, scheduler.kvwarm_sweep = recording_schedule, sweep
    try:
        for _ in range(3000):
            if sweep.done:
                break
            core.step()
    finally:
        scheduler.kvwarm_sweep = None
        del scheduler.schedule
    decode_row, *mixed_rows = sweep.rows
    assert decode_row.sample_reasons == ["kvwarm_real_kv", "kvwarm_state_exact", "kvwarm_state_depth=450"]
    assert [(r.point_type, r.kv_seed_regime, r.sample_reasons) for r in mixed_rows] == [
        ("mixed", "real_kv", ["prefill_real_seed", "kvwarm_real_kv", "kvwarm_state_exact", "kvwarm_state_depth=450"]),
        ("mixed", "real_kv", ["kvwarm_real_kv", "kvwarm_state_exact", "kvwarm_state_depth=151"]),
    ], [r.detail for r in mixed_rows]
    assert [r.point["decode"] for r in mixed_rows] == [
        {"batch_size": 2, "total_kv_read_tokens": 900},
        {"batch_size": 2, "total_kv_read_tokens": 301},
    ]

    def composition(output) -> tuple:
        """(shadows, their tokens, shot requests, their new tokens, their hit, others)."""
        scheduled = output.num_scheduled_tokens
        shadows = [i for i in scheduled if i.startswith(SHADOW_PREFIX)]
        shot = [r for r in output.scheduled_new_reqs if r.req_id.startswith(PREFILL_PREFIX)]
        others = set(scheduled) - set(shadows) - {r.req_id for r in shot}
        hit = sum(r.num_computed_tokens for r in shot)
        return (
            len(shadows),
            sorted({scheduled[i] for i in shadows}),
            len(shot),
            sum(scheduled[r.req_id] for r in shot),
            hit,
            len(others),
        )

    shots = [composition(o) for o in outputs if composition(o)[2]]
    assert shots == [(2, [1], 1, 24, unit, 0)] * 4 + [(2, [1], 2, 30, 0, 0)] * 4  # the warm shot and 3 timed
    for row in mixed_rows:
        assert len(row.samples) == 3 and all(t > 0 for t in row.samples)
        assert row.median_seconds == sorted(row.samples)[1]
    # Two catch-ups per point, each run from the last boundary state the chains cached to its
    # context (one short of the point's; a mixed point's one more, for the gap step its
    # shadows run after the warm shot) and never decoded; none ran beside a shot (`others`
    # above is 0).
    catchups: dict[str, int] = {}
    for output in outputs:
        for rid, n in output.num_scheduled_tokens.items():
            if "catchup" in rid:
                catchups[rid] = catchups.get(rid, 0) + n
    assert sorted(catchups.values()) == sorted([449 % unit] * 2 + [448 % unit] * 2 + [149 % unit, 148 % unit])
    assert not [r for r in scheduler.requests if "catchup" in r]
    assert sweep.reset_prefix_cache_ok
