"""Exact recurrent state on the real CPU engine, shared by the hybrid-model tests
(Qwen3-Next, NemotronH): at contexts off the state-block boundaries, shadows lent by
catch-up chains (DYN_BENCH_KV_WARMUP_STATE=exact) decode the same greedy tokens as natural
requests over the chain's first ctx + 1 tokens. Copy and in place, which read the chain's
state at its whole depth, are compared at the same contexts and reported, not asserted."""

from __future__ import annotations

import json
import random

from vllm.kvwarm.kv.catchup import PrefillChunkCap, cached_tokens, catchup_request, is_caught_up, state_block_size
from vllm.kvwarm.kv.chains import chain_request, is_prefilled, park
from vllm.kvwarm.kv.injector import Admission
from vllm.kvwarm.kv.layout import group_layouts
from vllm.kvwarm.kv.state_mode import STATE_ENV, decide_state_mode

from .fidelity import STEPS, prefill_and_park, step_core_until

# A lead (in logprob) the order of a chunked prefill's bf16 sums can turn: the one seen
# (Qwen3-Next, vLLM's CPU engine) was 0.02. A wrong state moves the whole distribution.
NEAR_TIE = 0.03


def off_boundary_contexts(depth: int, block: int) -> list[int]:
    """Depth - 1, the middle of the last whole block, and just past each boundary."""
    boundaries = range(block, depth - 1, block)
    return sorted({depth - 1, block + block // 2, *(b + 1 for b in boundaries)})


def _prefilled_chain(engine, name: str, tokens: list[int], block: int | None):
    """A parked chain; with `block`, prefilled one state block per step (boundaries cached)."""
    scheduler = engine.scheduler
    chain = chain_request(scheduler, name, tokens)
    cap = PrefillChunkCap(scheduler, block) if block else None
    if cap:
        cap.apply()
    try:
        scheduler.add_request(chain)
        prefill_and_park(scheduler, engine.core, chain)
    finally:
        if cap:
            cap.restore()
    return chain


def _catch_up(engine, chain, ctx: int, name: str):
    """A parked catch-up at ctx, and how many of its tokens the prefix cache held."""
    scheduler = engine.scheduler
    catchup = catchup_request(scheduler, chain, ctx, name)
    hit = cached_tokens(scheduler.kv_cache_manager, catchup)
    scheduler.add_request(catchup)

    def ready() -> bool:
        if is_caught_up(catchup):
            park(scheduler, catchup)
        return is_prefilled(catchup) and catchup not in scheduler.running

    step_core_until(engine.core, ready)
    return catchup, hit


def _shadow_tokens(engine, lenders: list, contexts: list[int], mode: str, prompt_chain=None) -> list[list[int]]:
    prompts = [prompt_chain] * len(contexts) if prompt_chain else None
    point = engine.scheduler.kvwarm_injector.queue(
        Admission(lenders, contexts, steady_steps=STEPS - 1, state_mode=mode, prompt_chains=prompts)
    )
    step_core_until(engine.core, lambda: point.shadows and all(s.is_finished() for s in point.shadows))
    assert point.failure is None, point.failure
    return [list(s.output_token_ids) for s in point.shadows]


def _natural_tokens(engine, tokens: list[int], contexts: list[int], name: str) -> list[list[tuple[int, float]]]:
    """Per context, each greedy step's token and its lead over the runner-up (in logprob)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=2)
    prompts = [TokensPrompt(prompt_token_ids=tokens[: ctx + 1], cache_salt=f"natural-{name}-{ctx}") for ctx in contexts]
    outputs = [out.outputs[0] for out in engine.llm.generate(prompts, params, use_tqdm=False)]
    return [[(t, _lead(step, t)) for t, step in zip(out.token_ids, out.logprobs)] for out in outputs]


def _lead(step: dict, token: int) -> float:
    # logprobs=2: the two best, and the sampled token (greedy: the best of them)
    return step[token].logprob - max(v.logprob for k, v in step.items() if k != token)


def assert_greedy_like_natural(got: list[list[int]], natural: list[list[tuple[int, float]]], contexts) -> None:
    """Token for token the natural request's greedy tokens, up to a step where the natural
    request's top two were within bf16's rounding of each other (a near-tie that the split
    of a prefill into chunks can turn): there the shadow may take the other, and the two
    sequences legitimately part. A wrong state moves every logit, not only a tie's."""
    for ctx, shadow, steps in zip(contexts, got, natural):
        for i, (token, (want, lead)) in enumerate(zip(shadow, steps)):
            if token != want:
                assert lead < NEAR_TIE, {"context": ctx, "step": i, "shadow": shadow, "natural": steps}
                break
        assert len(shadow) == len(steps), {"context": ctx, "shadow": shadow, "natural": steps}


def _release(engine, requests) -> None:
    from vllm.v1.request import RequestStatus

    engine.scheduler.finish_requests([r.request_id for r in requests], RequestStatus.FINISHED_ABORTED)
    engine.core.step()


def check_exact_state(engine, name: str, vocab: int) -> dict:
    """Asserts the exact-mode fidelity and the catch-ups' boundary hits; returns what copy
    and in place gave at the same contexts (for the report)."""
    kvm = engine.kv_cache_manager
    layouts = group_layouts(kvm)
    decision = decide_state_mode(kvm, layouts, {STATE_ENV: "exact"})
    assert decision.mode == "exact" and decision.lending in ("inplace", "copy"), decision
    block = state_block_size(layouts)
    depth = min(2 * block + block // 2, engine.llm.llm_engine.model_config.max_model_len - 16)
    # the copy and in-place chains run STEPS past the deepest context (room for the shadows' tails)
    tokens = random.Random(3).choices(range(3, vocab), k=depth + STEPS)
    contexts = off_boundary_contexts(depth, block)
    natural = _natural_tokens(engine, tokens, contexts, name)

    chain = _prefilled_chain(engine, f"{name}-exact", tokens[:depth], block)
    catchups, hits = zip(*[_catch_up(engine, chain, ctx, f"{name}-catchup-{ctx}") for ctx in contexts])
    catchups, hits = list(catchups), list(hits)
    # vLLM's prefix lookup found each the state of the last boundary before its context (or later)
    assert all((ctx - 1) // block * block <= hit < ctx for hit, ctx in zip(hits, contexts)), (hits, contexts, block)
    exact = _shadow_tokens(engine, catchups, contexts, decision.lending, prompt_chain=chain)
    _release(engine, [chain, *catchups])
    assert_greedy_like_natural(exact, natural, contexts)

    report = {
        "model": name,
        "state_block": block,
        "chain_depth": depth + STEPS,
        "contexts": contexts,
        "exact_catchup_hits": hits,
    }
    copy_chain = _prefilled_chain(engine, f"{name}-copy", tokens, None)
    copied = _shadow_tokens(engine, [copy_chain] * len(contexts), contexts, "copy")
    _release(engine, [copy_chain])
    report["copy_matching_tokens"] = _matching(copied, natural)
    # In place advances the chain's state: one chain per context.
    in_place = []
    for ctx in contexts:
        own = _prefilled_chain(engine, f"{name}-inplace-{ctx}", tokens, None)
        in_place += _shadow_tokens(engine, [own], [ctx], "inplace")
        _release(engine, [own])
    report["inplace_matching_tokens"] = _matching(in_place, natural)
    pool = kvm.block_pool
    assert not [b for b in pool.blocks if b.ref_cnt and not b.is_null]
    assert pool.reset_prefix_cache()
    return report


def _matching(tokens: list[list[int]], natural: list[list[tuple[int, float]]]) -> list[str]:
    """Per context, how many of the STEPS greedy tokens match the natural request's."""
    return [f"{sum(a == b for a, (b, _) in zip(got, want))}/{STEPS}" for got, want in zip(tokens, natural)]


def print_report(report: dict, capsys) -> None:
    """Shown in the test log whatever pytest captures: copy and in place off the boundaries."""
    with capsys.disabled():
        print("\nkvwarm exact-state report: " + json.dumps(report))
