"""Real and fake KV in one boot (`sweep ... --ab`, `"ab": true`): every point measured both
ways back to back in one engine, so an A/B of the warm-up carries no boot-to-boot noise.

Each point plan becomes two, of the same shape: its real side (the plan as the sweep has it:
borrowed KV or a real prefix where the rung's chains cover it, else the fake fallback) and its
fake side (fake KV, regime legacy, or a fake prefix), measured beside the rung's resident
chains, whose depth leaves room for the fake side's blocks (sweep.plan.trim_rung); a fake
side that does not fit even so is skipped by name, as any point whose requests cannot be
admitted. The sides alternate: at a point of even index in the sweep's point list the real
side runs first, at an odd one the fake side, so neither side always follows a rung build or
the other side. The order is a function of the point list alone, the same on every rank and
in every boot of a resumed sweep.

The real side's rows are the artifact's table (`results`, `skipped_points`: what every reader
takes), the fake side's its `ab_fake_side` block (record.artifact); `report` of one A/B
artifact compares them.
"""

from __future__ import annotations

from collections.abc import Callable

from ..record import vocabulary as v
from .plan import PointPlan

AB_RECORD = {"first": "alternate"}  # the artifact's kvwarm.ab


def real_first(index: int) -> bool:
    """Whether the real side runs first at the point of this index."""
    return index % 2 == 0


def ab_pairs(plans: list[PointPlan], index_of: Callable[[PointPlan], int]) -> list[PointPlan]:
    """Each plan as its two sides, back to back, in the order real_first gives."""
    paired = []
    for plan in plans:
        first = real_first(index_of(plan))
        real = PointPlan(plan.point, plan.real, beyond=plan.beyond, ab=v.AB_REAL, ab_first=first)
        fake = PointPlan(plan.point, False, beyond=plan.beyond, ab=v.AB_FAKE, ab_first=not first)
        paired += [real, fake] if first else [fake, real]
    return paired
