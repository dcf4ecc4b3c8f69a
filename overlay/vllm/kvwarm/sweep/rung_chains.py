"""A rung's chains inside a sweep (sweep.controller; the requests themselves: kv.chains): added
for the rung's batch, each parked once its prompt is scheduled, and ended when the rung is
shed or its chains must be built again (a prefill point's restage).
"""

from __future__ import annotations

from collections.abc import Callable

from ..kv.catchup import PrefillChunkCap, state_block_size
from ..kv.chains import all_parked, chain_request, park, prompt_scheduled
from ..kv.layout import STATE_ALIGN, group_layouts
from ..record import vocabulary as v
from .plan import Rung, SweepConfig


def add_chains(
    scheduler, rung: Rung, chain_tokens: Callable[[int, int], list[int]], config: SweepConfig, number: int
) -> PrefillChunkCap | None:
    """The rung's B chains of its depth, added to the scheduler (`number`: the sweep's, in
    their ids); the prefill chunk cap applied while they are built, where one is needed."""
    for i in range(rung.batch_size):
        # The salt is the chain's index, not the rung's: chain i of a later rung extends
        # the same text, so it finds the earlier chain's blocks in the prefix cache. Not
        # in place: shadows advanced those chains' state, which must not be inherited.
        name = f"b{rung.batch_size}_{i}_s{number}"
        salt = None if config.state_mode == v.INPLACE and not rung.prefill else f"__kvwarm_chain_{i}"
        chain = chain_request(scheduler, name, chain_tokens(i, rung.depth), salt=salt)
        scheduler.add_request(chain)
        rung.chains.append(chain)
    layouts = group_layouts(scheduler.kv_cache_manager)
    prefixes = rung.prefill or rung.mixed
    if config.state_mode == v.EXACT or (prefixes and any(g.kind == STATE_ALIGN for g in layouts)):
        # One state block per prefill step: every boundary state is cached, for the
        # catch-ups (exact state) and for prefill (and mixed) points' hits at block boundaries.
        cap = PrefillChunkCap(scheduler, state_block_size(layouts))
        cap.apply()
        return cap
    return None


def park_built(scheduler, chains: list) -> bool:
    """Park each chain once its prompt is scheduled, before a step could decode it (under
    vLLM's batch queue its last chunk may still be in flight then); True once all are parked."""
    for chain in chains:
        if prompt_scheduled(chain):
            park(scheduler, chain)
    return all_parked(scheduler, chains)


def end_chains(scheduler, rung: Rung) -> None:
    """The rung's chains, if any, finished (aborted) and let go of."""
    from vllm.v1.request import RequestStatus

    if rung.chains:
        scheduler.finish_requests([c.request_id for c in rung.chains], RequestStatus.FINISHED_ABORTED)
        rung.chains = []
