"""A sweep's plan: one rung per batch size, each with a chain depth and the points it covers.

Words: a *point* is what the points file asks (points.DecodePoint); a *point plan* is a point
with how it will be measured (on real, borrowed KV or on fake KV); the injector's
*admission* is the point's requests (kv.injector.Admission); a *row* is what was measured
(record.artifact.PointRow).

A rung's chains cover its deepest point plus the admission token and the decode steps (the
timed steady steps, and under vLLM's batch queue one untimed step after them), within
max_model_len less a margin; the depth is trimmed until B chains and their shadows'
worst-case tails fit the free pool, and the points the trimmed chains cannot cover fall back
to fake KV. Pure functions of the points, the config and the layout, so every data-parallel
rank computes the same plan (they compare digests before a rung).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from ..kv.arithmetic import chain_blocks, trim_depth
from ..kv.catchup import planned_catchup_blocks
from ..kv.layout import GroupLayout
from ..record.vocabulary import COPY, EXACT, FAKE_FALLBACK
from .points import DecodePoint, MixedPoint, PrefillPoint, mixed_decode_steps

# A parked chain has sampled a token or two (async scheduling) after its prompt; at
# max_model_len vLLM would finish it, freeing the blocks its shadows borrow.
CHAIN_DEPTH_MARGIN = 4
TRIM_FLOOR = 8  # the shallowest chains a trim leaves (kv.arithmetic.trim_depth's floor)


@dataclass(frozen=True)
class SweepConfig:
    steady_steps: int  # timed steady steps per point
    max_model_len: int
    state_mode: str | None = None  # the state hand-off mode on hybrid layouts: copy | inplace | exact
    state_lending: str | None = None  # exact: how a catch-up's state is handed over (inplace | copy)
    fork: bool | None = None  # attention tails: fork (CoW) or fresh; None: fork where the build can
    real: bool = True  # False: no chains, every point on fake KV
    fake_regime: str = FAKE_FALLBACK  # the regime of fake-KV rows: fake_fallback | legacy
    giant_kv_threshold: int = 1_000_000  # fake points below it keep the single legacy step
    gc_hold: bool = True  # keep Python's collector out of the timed steps (sweep.gc_hold)
    # Untimed decode steps after the timed ones: 1 under vLLM's batch queue, where the window
    # of a point's last timed step holds the schedule() of the step after it (sweep.provenance)
    trailing_steps: int = 0
    # Untimed steps of a point's shape before its timed ones (settings.SETTLE_ENV): a decode
    # point's requests are admitted that many tokens short, so its timed steps read its K
    settle_steps: int = 0
    # Real and fake KV in one boot (--ab, sweep.ab): every point measured both ways, back to
    # back; a rung's chains leave room for the fake side's blocks beside them
    ab: bool = False

    @property
    def decode_steps(self) -> int:
        """The steps a decode point's requests run after their admission step."""
        return self.settle_steps + self.steady_steps + self.trailing_steps

    @property
    def hand_off(self) -> str | None:
        """How shadows take state over (exact: from their catch-ups)."""
        return self.state_lending if self.state_mode == EXACT else self.state_mode


@dataclass
class SweepSetup:
    """What a sweep measures and how: the points, the chains' text, the config, the prefill
    tails' text (the sweep's own arguments of those names)."""

    points: list
    chain_tokens: Callable[[int, int], list[int]] | None
    config: SweepConfig
    tail_tokens: list[int] | None = None


@dataclass
class PointPlan:
    point: DecodePoint | PrefillPoint
    real: bool  # on borrowed (real) KV, or a real prefix; False: on fake KV / a fake prefix
    retried: bool = False  # prefill: the chains were built again once for it
    beyond: bool = False  # beyond the rung's chains (its fake points): measured once they are gone
    ab: str | None = None  # an A/B sweep's side (vocabulary AB_SIDES; sweep.ab)
    ab_first: bool | None = None  # that side runs first at its point

    @property
    def prefill(self) -> bool:
        return isinstance(self.point, PrefillPoint)

    @property
    def mixed(self) -> bool:
        return isinstance(self.point, MixedPoint)


@dataclass
class Rung:
    batch_size: int
    depth: int  # 0: no chains (every point on fake KV); a prefill rung's is set when it is planned
    points: list[DecodePoint | PrefillPoint]
    fake_points: list[DecodePoint | PrefillPoint] = field(default_factory=list)
    chains: list = field(default_factory=list)
    started: float = 0.0
    prefill: bool = False  # a rung of prefill points (its chains hold their prefixes)
    mixed: bool = False  # a rung of mixed points (its chains lend to both parts)

    def plans(self) -> list[PointPlan]:
        """The rung's points in the order they run: on real KV (a real prefix), then fake."""
        return [PointPlan(p, True) for p in self.points] + [PointPlan(p, False, beyond=True) for p in self.fake_points]


def injected_contexts(point: DecodePoint, settle: int = 0) -> list[int]:
    """One token short of each context (the admission step computes the last one), and
    `settle` more (the settle steps decode them); a context too short for that is admitted
    at 1 and the point is clamped."""
    return [max(1, c - 1 - settle) for c in point.contexts()]


def settled_contexts(admitted: list[int], settle: int) -> list[int]:
    """The contexts as admitted (injected_contexts) advanced by the `settle` steps: where
    the point's timed steps start, the contexts its row reports."""
    return [c + settle for c in admitted]


def plan_rungs(
    points: list[DecodePoint | PrefillPoint], decode_steps: int, max_model_len: int, real: bool = True
) -> list[Rung]:
    """The prefill rungs, then the decode rungs, then the mixed ones: one rung per batch size
    (a mixed rung's: its chains, the larger part's batch), largest first, its points deepest
    first; `decode_steps`: SweepConfig.decode_steps."""
    prefill = [p for p in points if isinstance(p, PrefillPoint)]
    decode = [p for p in points if isinstance(p, DecodePoint)]
    rungs = []
    for batch, rung_points in _by_batch(prefill):
        rung_points.sort(key=lambda p: (p.total_kv_read_tokens, p.total_prefill_tokens), reverse=True)
        rungs.append(
            Rung(batch, 0, rung_points, prefill=True) if real else Rung(batch, 0, [], rung_points, prefill=True)
        )
    for batch, rung_points in _by_batch(decode):
        rung_points.sort(key=lambda p: p.total_kv_read_tokens, reverse=True)
        if not real:
            rungs.append(Rung(batch, 0, [], fake_points=rung_points))
            continue
        # admitted one token short: the chain holds that much, the admission token and the steps
        depth = max(max(injected_contexts(p)) for p in rung_points) + 1 + decode_steps
        rungs.append(Rung(batch, min(depth, max_model_len - CHAIN_DEPTH_MARGIN), rung_points))
    mixed = [p for p in points if isinstance(p, MixedPoint)]
    for batch, rung_points in _by_batch(mixed, key=mixed_chains):
        rung_points.sort(key=lambda p: (p.decode.total_kv_read_tokens, p.prefill.total_kv_read_tokens), reverse=True)
        rungs.append(Rung(batch, 0, rung_points, mixed=True) if real else Rung(batch, 0, [], rung_points, mixed=True))
    return rungs


def mixed_chains(point: MixedPoint) -> int:
    """The chains a mixed point borrows: chain i lends to decode request i and prefix i."""
    return max(point.decode.batch_size, point.prefill.batch_size)


def trim_rung(rung: Rung, layouts: list[GroupLayout], config: SweepConfig, usable: int) -> None:
    """Trim the rung's depth to `usable` free blocks; what the chains no longer cover goes
    to fake KV, and a rung covering nothing gets no chains."""
    catchup = planned_catchup_blocks(layouts) if config.state_mode == EXACT else 0
    rung.depth = trim_depth(
        layouts, rung.depth, rung.batch_size, config.decode_steps, config.hand_off == COPY, usable, per_shadow=catchup
    )
    if config.ab:  # the fake side's requests (as deep as the chains at most) hold blocks of their own beside them
        while rung.depth > TRIM_FLOOR and rung.batch_size * chain_blocks(layouts, rung.depth) * 2 > usable:
            rung.depth -= 1
    # A shadow's prompt is the chain's first ctx + 1 tokens; its steady tokens are its own.
    covered = [p for p in rung.points if max(injected_contexts(p)) + 1 <= rung.depth]
    rung.fake_points = [p for p in rung.points if p not in covered]
    rung.points = covered
    if not covered:  # nothing to borrow from: no chains at all
        rung.depth = 0


def points_digest(points: list) -> str:
    """The sweep's points, hashed once (plan_digest takes it at every rung)."""
    return _digest([_named(p) for p in points])


def plan_digest(points: str, config: SweepConfig, rung: Rung) -> str:
    """What every rank must agree on before it builds a rung: the points (`points`: their
    points_digest), the rung's depth and points, and the settings that shape rows and stamps.
    Its cost is the rung's, not the sweep's: a table of 50,000 points hashed whole at each
    rung held the engine for a second a rung."""
    plan = {
        "points": points,
        "config": asdict(config),
        "rung": {
            "batch": rung.batch_size,
            "depth": rung.depth,
            "real": [_named(p) for p in rung.points],
            "fake": [_named(p) for p in rung.fake_points],
        },
    }
    return _digest(plan)


def _named(p) -> str:
    """A point as its dataclass shows it (kind and fields, its parts' too): a tenth of asdict's cost."""
    return repr(p)


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _by_batch(points: list, key=lambda p: p.batch_size) -> list[tuple[int, list]]:
    by_batch: dict[int, list] = {}
    for point in points:
        by_batch.setdefault(key(point), []).append(point)
    return sorted(by_batch.items(), reverse=True)


def plan_prefill_rung(rung: Rung, unit: int) -> None:
    """A prefill rung's chains are as deep as its deepest prefix (none without a prefix)."""
    rung.depth = max((max(p.prefixes(unit)) for p in rung.points), default=0)


def plan_mixed_rung(rung: Rung, unit: int, config: SweepConfig) -> None:
    """A mixed rung's chains cover its deepest decode part (contexts, the admission token and
    the steps it runs) and its deepest prefix."""
    steps = mixed_decode_steps(config.decode_steps)
    depth = max(
        (max(max(injected_contexts(p.decode)) + 1 + steps, max(p.prefill.prefixes(unit))) for p in rung.points),
        default=0,
    )
    rung.depth = min(depth, config.max_model_len - CHAIN_DEPTH_MARGIN) if depth else 0
