"""How recurrent state is handed to shadows, decided from the layout and the build only.

DYN_BENCH_KV_WARMUP_STATE = auto | copy | inplace | exact (default auto, any case) is read
only on layouts with align-mode state groups. exact (kv/catchup.py) lends each shadow a
catch-up chain prefilled to the shadow's own context, handed over by copy where the build
can fork, else in place where that is safe; a build with neither refuses it. auto means
exact (its extra cost is untimed; docs/state-handoff.md says why). copy reads the chain's
state at its whole depth: cheaper, approximate, and only on request. The decision never
looks at the free pool, so every data-parallel rank decides, and stamps, the same.

In place is unsafe where a manager hashes partial state tails of a borrowed request
(stock 0.28.0's `_cache_partial_tail_block`: the shadow's key stacks on the chain's
block and the promotion check fails a few steps later); a build whose managers exempt
borrowed requests from hashing (`Request.borrowed_kv`) is safe. Safe is not faithful: an
in-place shadow shares the chain's state block, so it is exempt from the prefix-cache work
a natural request's step does, and its timed schedule() is lighter. So in place is only the
hand-off of a build that cannot fork; where the build can, `inplace` is refused
(`state_inplace_unfaithful`) and copy does what it would.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..record.vocabulary import (
    AUTO,
    COPY,
    EXACT,
    HYBRID_STATE_LAYERS_UNSUPPORTED,
    INPLACE,
    STATE_COPY_UNSUPPORTED,
    STATE_EXACT_UNSUPPORTED,
    STATE_HAND_OFF_UNSUPPORTED,
    STATE_INPLACE_UNFAITHFUL,
    STATE_INPLACE_UNSUPPORTED,
    STATE_MODE_INVALID,
    STATE_MODES,
)
from .capabilities import hashes_partial_tails
from .layout import STATE_ALIGN, STATE_OTHER, GroupLayout

STATE_ENV = "DYN_BENCH_KV_WARMUP_STATE"


@dataclass(frozen=True)
class StateBuild:
    """What the build's state managers can do (from probes of the live objects)."""

    can_fork: bool  # every state manager has _apply_cow
    inplace_ok: bool  # no state manager hashes partial tails of borrowed requests

    def lending_mode(self) -> str | None:
        """How exact mode hands a catch-up chain's state over: by copy where the build can
        fork (a copy-lent shadow is hashed like a natural request, so its steps do the same
        prefix-cache work: kv.shadows), else in place where that is safe; None: neither.
        The copy costs one state block a shadow and a page copy in the untimed admission."""
        return COPY if self.can_fork else INPLACE if self.inplace_ok else None


@dataclass(frozen=True)
class StateDecision:
    requested: str | None  # the raw environment value, as given (None: unset)
    mode: str | None  # copy | inplace | exact; None on layouts without state groups or when refused
    reason: str | None  # the gate's skip reason when refused
    lending: str | None = None  # exact: how catch-up chains hand their state over (inplace | copy)

    def metadata(self) -> dict:
        return {"state_mode_requested": self.requested, "state_mode": self.mode}


def _hashes_borrowed_partial_tails(group: GroupLayout, hash_block_size: int, borrowed_exempt: bool) -> bool:
    return hashes_partial_tails(group.manager) and group.block_size != hash_block_size and not borrowed_exempt


def probe_state_build(layouts: list[GroupLayout], kv_cache_manager) -> StateBuild:
    from vllm.v1.request import Request

    state_groups = [g for g in layouts if g.kind == STATE_ALIGN]
    hash_bs = kv_cache_manager.block_pool.hash_block_size
    exempt = hasattr(Request, "borrowed_kv")
    return StateBuild(
        can_fork=all(g.can_fork for g in state_groups),
        inplace_ok=not any(_hashes_borrowed_partial_tails(g, hash_bs, exempt) for g in state_groups),
    )


def resolve_state_mode(layouts: list[GroupLayout], build: StateBuild, requested: str | None) -> StateDecision:
    """The state mode for this layout on this build, or the reason the gate refuses."""

    def refuse(reason: str) -> StateDecision:
        return StateDecision(requested, None, reason)

    if any(g.kind == STATE_OTHER for g in layouts):
        return refuse(HYBRID_STATE_LAYERS_UNSUPPORTED)
    if not any(g.kind == STATE_ALIGN for g in layouts):
        return StateDecision(requested, None, None)
    wanted = (requested or AUTO).strip().lower()
    if wanted not in STATE_MODES:
        return refuse(STATE_MODE_INVALID)
    if wanted == EXACT:
        lending = build.lending_mode()
        return StateDecision(requested, EXACT, None, lending) if lending else refuse(STATE_EXACT_UNSUPPORTED)
    if wanted == COPY:
        return StateDecision(requested, COPY, None) if build.can_fork else refuse(STATE_COPY_UNSUPPORTED)
    if wanted == INPLACE:
        if not build.inplace_ok:
            return refuse(STATE_INPLACE_UNSUPPORTED)
        return refuse(STATE_INPLACE_UNFAITHFUL) if build.can_fork else StateDecision(requested, INPLACE, None)
    # auto: exact wherever the build can lend catch-ups (docs/state-handoff.md, "auto")
    lending = build.lending_mode()
    return StateDecision(requested, EXACT, None, lending) if lending else refuse(STATE_HAND_OFF_UNSUPPORTED)


def refusal_hint(reason: str | None) -> str | None:
    """What to set instead, where the refused mode was one a user asked for."""
    instead = {
        STATE_COPY_UNSUPPORTED: "exact or auto",
        STATE_INPLACE_UNSUPPORTED: "copy, exact or auto",
        STATE_INPLACE_UNFAITHFUL: "copy (the same state, stepped as a natural request is), exact or auto",
    }.get(reason)
    return f"set {STATE_ENV} to {instead}" if instead else None


def decide_state_mode(kv_cache_manager, layouts: list[GroupLayout], environ) -> StateDecision:
    """resolve_state_mode for the live manager and the environment."""
    return resolve_state_mode(layouts, probe_state_build(layouts, kv_cache_manager), environ.get(STATE_ENV))
