"""Which point plans a rung measures, and in what order (sweep.controller): every point of the
rung, real ones first, then those beyond its chains (sweep.plan.Rung.plans), less the points
an earlier boot finished (a resumed sweep, sweep.resume), each as its two sides in an A/B
sweep (sweep.ab). A point is known by its index in the sweep's point list, the same on every
rank and in every boot.
"""

from __future__ import annotations

from .ab import ab_pairs
from .plan import PointPlan, Rung


class PointOrder:
    def __init__(self, points: list, ab: bool):
        self._index = {id(p): i for i, p in enumerate(points)}
        self.ab = ab
        self.done: set[int] = set()  # the points an earlier boot finished, on every rank
        self.rows = len(points) * (2 if ab else 1)  # the rows of the sweep once complete

    def index_of(self, plan: PointPlan) -> int:
        return self._index[id(plan.point)]

    def finished(self, rung: Rung) -> bool:
        """Every point of the rung was measured in an earlier boot: it is not built."""
        return all(self._index[id(p)] in self.done for p in [*rung.points, *rung.fake_points])

    def plans(self, rung: Rung) -> list[PointPlan]:
        """The rung's plans left to measure, in their order."""
        plans = [p for p in rung.plans() if self.index_of(p) not in self.done]
        return ab_pairs(plans, self.index_of) if self.ab else plans
