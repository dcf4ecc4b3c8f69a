"""The shadow fidelity check shared by the engine tests (one rank and tensor parallel) and the
first light: on a parked chain, shadows admitted through the scheduler adapter decode the same
greedy tokens as natural requests whose prompt is the chain's first ctx + 1 tokens.

The engine core is stepped by its own loop function (`EngineCore.step_fn`): `step` one step
at a time, `step_with_batch_queue` under async scheduling (vLLM's default on CUDA), where each
call schedules the next step before the last one's output is in."""

from __future__ import annotations

import random

from vllm.kvwarm.kv.chains import chain_request, is_prefilled, park, prompt_scheduled
from vllm.kvwarm.kv.injector import Admission

CONTEXTS = [100, 128, 200, 255]
STEPS = 5  # decoded tokens per shadow: the admission token and 4 steady steps


def step_core_until(core, done, limit=200):
    """Step `core` (an EngineCore) by its own loop function until done() holds."""
    for _ in range(limit):
        if done():
            return
        core.step_fn()
    raise AssertionError("the engine did not get there in time")


def prefill_and_park(scheduler, core, chain) -> None:
    """Step until `chain` is prefilled, parking it as soon as its whole prompt is scheduled,
    as the sweep's controller does. Under the batch queue a chain whose prompt is scheduled
    is scheduled again (a decode) before its last chunk's output is in, so it always has a
    token in flight: waiting for it to be prefilled before parking it never ends."""

    def parked_and_prefilled() -> bool:
        if prompt_scheduled(chain):
            park(scheduler, chain)
        return is_prefilled(chain) and chain not in scheduler.running

    step_core_until(core, parked_and_prefilled)


def shadow_and_natural_tokens(llm, core, fork: bool, name: str) -> tuple[list, list]:
    """Greedy tokens of shadows at CONTEXTS and of natural requests over the same prefixes
    (`core`: the LLM's in-process EngineCore); the chain is released at the end and nothing
    may stay in use."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.request import RequestStatus

    scheduler = core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    tokens = random.Random(1).choices(range(3, 400), k=300)
    chain = chain_request(scheduler, name, tokens)
    scheduler.add_request(chain)
    prefill_and_park(scheduler, core, chain)
    assert chain.num_computed_tokens == len(tokens), "the chain decoded past its prompt before it was parked"

    point = scheduler.kvwarm_injector.queue(
        Admission([chain] * len(CONTEXTS), CONTEXTS, steady_steps=STEPS - 1, fork=fork)
    )
    step_core_until(core, lambda: point.shadows and all(s.is_finished() for s in point.shadows))
    assert point.failure is None
    shadow_tokens = [list(s.output_token_ids) for s in point.shadows]

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    prompts = [
        TokensPrompt(prompt_token_ids=chain.all_token_ids[: ctx + 1], cache_salt=f"natural-{name}-{ctx}")
        for ctx in CONTEXTS
    ]
    natural = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]

    scheduler.finish_requests([chain.request_id], RequestStatus.FINISHED_ABORTED)
    step_core_until(core, lambda: not scheduler.has_requests() and not core.batch_queue)
    assert not [b for b in pool.blocks if b.ref_cnt and not b.is_null]
    assert pool.reset_prefix_cache()
    return shadow_tokens, natural
