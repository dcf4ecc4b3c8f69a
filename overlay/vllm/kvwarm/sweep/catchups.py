"""Exact state mode's flow inside a sweep: a point's catch-up chains (kv.catchup), added when
the pool holds them and the shadows beside them, parked as each stands at its context, then
lent to the point's shadows.

A point whose catch-ups do not fit gets none and is skipped, named, after the ranks meet as
they would have: a rank with a smaller pool stays in step.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kv.arithmetic import pool_shortfall, shadow_private_blocks
from ..kv.catchup import cached_tokens, catchup_blocks, catchup_request, is_caught_up
from ..kv.chains import all_parked, park
from ..kv.injector import Admission
from ..kv.layout import group_layouts
from ..record.vocabulary import COPY, POOL_EXHAUSTED
from .plan import PointPlan, SweepConfig


@dataclass
class CatchUps:
    """A point's catch-up chains, prefilling before its shadows are queued."""

    plan: PointPlan
    contexts: list[int]
    steady_steps: int
    requests: list
    short: str | None = None  # why none were added (the pool); the point is then skipped


def start_catchups(
    scheduler, plan: PointPlan, chains: list, contexts: list[int], steady_steps: int, config: SweepConfig, name: str
) -> CatchUps:
    """A catch-up per shadow, added to the scheduler where the pool holds them; `name`
    tells the requests of this point apart ({name}_{i})."""
    kvm = scheduler.kv_cache_manager
    layouts = group_layouts(kvm)
    requests = [
        catchup_request(scheduler, chain, ctx, f"{name}_{i}") for i, (chain, ctx) in enumerate(zip(chains, contexts))
    ]
    need = sum(
        catchup_blocks(layouts, ctx, cached_tokens(kvm, r))
        + shadow_private_blocks(layouts, ctx, steady_steps, config.hand_off == COPY)
        for r, ctx in zip(requests, contexts)
    )
    short = pool_shortfall(need, kvm.block_pool.get_num_free_blocks())
    if short:
        return CatchUps(
            plan,
            contexts,
            steady_steps,
            [],
            short=(f"{POOL_EXHAUSTED}: {short} more free block(s) needed for the catch-up chains and shadows"),
        )
    for request in requests:
        scheduler.add_request(request)
    return CatchUps(plan, contexts, steady_steps, requests)


def park_caught_up(scheduler, catchups: CatchUps) -> bool:
    """Park each catch-up once its prompt is scheduled; True once every one is parked."""
    for request in catchups.requests:
        if is_caught_up(request):
            park(scheduler, request)
    return all_parked(scheduler, catchups.requests)


def catchup_admission(catchups: CatchUps, chains: list, config: SweepConfig) -> Admission:
    """The point's shadows, borrowing from the catch-ups; their prompts are the chains' text."""
    return Admission(
        catchups.requests,
        catchups.contexts,
        steady_steps=catchups.steady_steps,
        fork=config.fork,
        state_mode=config.state_lending,
        prompt_chains=chains,
    )


def end_catchups(scheduler, catchups: CatchUps) -> None:
    """The point's catch-ups finished (aborted): it has ended."""
    from vllm.v1.request import RequestStatus

    scheduler.finish_requests([r.request_id for r in catchups.requests], RequestStatus.FINISHED_ABORTED)
